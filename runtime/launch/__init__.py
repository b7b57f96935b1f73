"""Start-up and supervision of the runtime's processes (scheduler, other ranks, detokenizer), each a fresh interpreter."""
