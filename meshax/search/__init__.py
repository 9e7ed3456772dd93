"""Layout search: a cost model of a step's time and memory, and the search over layout rules.

`search_layout` chooses layout rules, and `measure_layouts` times the best of them on the
devices; `result` is what a search returns (`SearchResult`, each layout a `Candidate`);
`weights` searches weight rules beside the rules; `cost` predicts time and memory from a plan;
`devices` holds the device table and `calibrate`; `draw` draws layouts and the search's comparison.
"""

from meshax.search.cost import Collective, Prediction, StepCost, predict
from meshax.search.devices import KNOWN_DEVICES, Device, Link, calibrate, load_device
from meshax.search.measure import measure_layouts
from meshax.search.result import Candidate, SearchResult
from meshax.search.search import (
    evaluate,
    exact_cost,
    mesh_shapes,
    search_layout,
    search_mesh_and_layout,
)

__all__ = [
    "KNOWN_DEVICES",
    "Candidate",
    "Collective",
    "Device",
    "Link",
    "Prediction",
    "SearchResult",
    "StepCost",
    "calibrate",
    "evaluate",
    "exact_cost",
    "load_device",
    "measure_layouts",
    "mesh_shapes",
    "predict",
    "search_layout",
    "search_mesh_and_layout",
]
