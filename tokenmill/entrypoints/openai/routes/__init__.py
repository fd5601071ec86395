"""The server's endpoints as FastAPI routers, one module a concern: `generate` (completions, chat, tokenize),
`embeddings`, `admin` (models and LoRA adapters), `health` (probes, load, version, metrics) and `page` (the
built-in page and its engine view). Each handler finds the server's parts on `request.app.state.parts`."""
