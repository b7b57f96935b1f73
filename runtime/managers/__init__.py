"""The runtime client (tokenize, send, gather, stream), detokenizer, launcher, IPC and wire messages."""
