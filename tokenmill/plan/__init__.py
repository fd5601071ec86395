"""`tokenmill plan`: what a model needs (weights, KV per token, concurrency) and how fast it should run on a device
(a roofline with measured efficiency factors), before any machine is bought or any replica started."""
