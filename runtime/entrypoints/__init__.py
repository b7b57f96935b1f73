"""HTTP server (native API), OpenAI API and protocol, Engine (the in-process API)."""
