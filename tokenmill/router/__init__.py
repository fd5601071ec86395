"""`tokenmill router`: one OpenAI-compatible front for many `tokenmill serve` replicas."""
