"""The batched-case helper must report wrong results and broken cases."""

import numpy as np
import pytest

import meshax as mx
from tests.conftest import B, D, check_cases, rand


def _good(mesh):
    x = mx.placeholder(mesh, "x", [B, D])
    xv = rand([8, 8], seed=1)
    return [(x * 2.0, xv * 2.0)], {x: xv}


def _wrong(mesh):
    x = mx.placeholder(mesh, "x", [B, D])
    xv = rand([8, 8], seed=2)
    return [(x * 2.0, xv * 2.0 + 1e-3)], {x: xv}


def _broken(mesh):
    raise RuntimeError("boom")


def test_check_cases_passes_good_cases():
    check_cases({"good": _good, "good2": _good}, mx.SimdMeshImpl, "b:rows;d:cols")


def test_check_cases_reports_wrong_values():
    with pytest.raises(AssertionError, match="wrong"):
        check_cases({"good": _good, "wrong": _wrong}, mx.SimdMeshImpl, "b:cols")


def test_check_cases_reports_broken_builders():
    with pytest.raises(AssertionError, match=r"broken.*boom"):
        check_cases({"good": _good, "broken": _broken}, mx.SimdMeshImpl, "")


def test_check_cases_compares_dtypes_of_exact_results():
    def _int(mesh):
        x = mx.placeholder(mesh, "x", [B], dtype="int32")
        xv = np.arange(8, dtype=np.int32)
        return [(x, xv.astype(np.int64))], {x: xv}

    with pytest.raises(AssertionError):
        check_cases({"int": _int}, mx.SimdMeshImpl, "")
