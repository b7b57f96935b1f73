"""The prompt-program DSL (@function, gen, select, fork); see issue #4."""
