"""Disaggregated prefill and decode: KV blocks handed from a prefill instance to a decode instance."""
