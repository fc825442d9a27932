"""The graph: the IR, op knowledge in tables, TensorFlow's registry and kernels, and graph files in and out."""
