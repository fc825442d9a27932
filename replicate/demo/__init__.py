"""The demo's pieces: MNIST-like data with fallbacks and the seeds' CNN as a plain TF1 graph.

``replicate demo`` (``replicate.cli.commands.demo``) and ``examples/mnist_towers.py`` use them.
"""

from replicate.demo.data import Dataset, batches, load
from replicate.demo.model import CNN, FULL_SIZE, SMALL_SIZE, build_cnn

__all__ = ["Dataset", "batches", "load", "CNN", "FULL_SIZE", "SMALL_SIZE", "build_cnn"]
