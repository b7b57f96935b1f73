"""What one forward step is, below the layers that read it: the batch and its mode (batch.py) and the interface
of a graph runner that runs a model's layer stack in one unit (graph.py)."""
