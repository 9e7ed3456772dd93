"""Operations, one module per family: shape inference, lowering and gradient side by side."""

from meshax.ops.einsum import einsum, matmul
from meshax.ops.elementwise import (
    abs, add, cast, cos, divide, equal, erf, exp, gelu, greater, greater_equal, identity, less,
    less_equal, log, logical_and, logical_not, logical_or, maximum, minimum, multiply, negative,
    not_equal, pow, reciprocal, relu, rsqrt, sigmoid, sign, sin, softplus, sqrt, square,
    stop_gradient, subtract, tanh, where,
)
from meshax.ops.indexing import gather, one_hot, top_k
from meshax.ops.inputs import constant, import_tensor, ones, ones_like, placeholder, range, zeros, zeros_like
from meshax.ops.layout_ops import shard
from meshax.ops.random import dropout, random_normal, random_uniform
from meshax.ops.reduce import (
    argmax, log_softmax, reduce_all, reduce_any, reduce_logsumexp, reduce_max, reduce_mean, reduce_min,
    reduce_sum, softmax,
)
from meshax.ops.shape_ops import broadcast, rename_dimension, replace_dimensions, reshape, transpose
from meshax.ops.slicing import concat, cumsum, pad, shift, slice, split, stack, unstack
from meshax.ops.variables import assign, assign_add, assign_sub, get_variable

__all__ = [n for n in dir() if not n.startswith("_") and n not in {
    "einsum_module", "elementwise", "indexing", "inputs", "layout_ops", "random", "reduce", "shape_ops", "slicing", "variables"}]
