"""Model runner and forward batch: what one forward computes and how it runs."""
