"""Model building blocks: rotary embedding and paged attention."""
