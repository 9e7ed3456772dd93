"""Exception classes users can catch by kind."""


class LayoutError(ValueError):
    """A layout that cannot be realised: two dims of one tensor on one mesh dim, or a split that
    does not divide. The message names the tensor, its dims and the mesh dim."""


class GraphError(ValueError):
    """An operation built with inputs that do not fit (wrong dims, mixed meshes, ...)."""
