"""Models written once with named dims; any layout trains them."""

from meshax.models.mlp import mnist_classifier, two_layer

__all__ = ["mnist_classifier", "two_layer"]
