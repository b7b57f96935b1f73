"""The runtime client (tokenize, send, gather, stream, data-parallel routing, results shaped as SGLang's) and
its metrics: what the HTTP server and the Engine share."""
