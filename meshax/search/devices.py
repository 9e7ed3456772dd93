"""What a device can do, for the cost model: peak throughput, memory, and its links per mesh dim.

A `Device` comes from the table of known devices (`KNOWN_DEVICES`, by name) or from a file
that `meshax calibrate` wrote after measuring the devices at hand (`calibrate`): a large
matmul's throughput, an elementwise op's throughput, and, per mesh dim and per group of mesh
dims a collective runs over together, the latency and bandwidth of an allreduce over it (the
alpha-beta model: a message of B bytes takes alpha + B / beta).
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import os
import time

from meshax.core.errors import ConfigError

GB = 1 << 30


@dataclasses.dataclass(frozen=True)
class Link:
    """The alpha-beta model of one mesh dim's links: seconds per message, bytes per second."""

    latency_s: float
    bandwidth: float


@dataclasses.dataclass(frozen=True)
class Device:
    """One device's peaks (FLOP/s per device), memory, and links (per mesh dim name; `link`
    stands for every mesh dim not named in `links`)."""

    name: str
    matmul_flops: float  # dense matmul/convolution FLOP/s, at the dtype the model computes in
    vector_flops: float  # every other op's FLOP/s (elementwise, reductions): memory-bound ops
    memory_bytes: int
    link: Link
    links: tuple[tuple[str, Link], ...] = ()

    def __post_init__(self) -> None:
        # (links as a tuple of pairs, however given: a Device is hashed when predictions are memoized)
        links = self.links.items() if isinstance(self.links, dict) else self.links
        object.__setattr__(self, "links", tuple((m, link) for m, link in links))

    def link_of(self, mesh_dims: tuple[str, ...]) -> Link:
        """The link a collective over `mesh_dims` runs at: measured for that group of mesh dims
        (`links` keyed "rows,cols"), else the slowest of theirs."""
        named = dict(self.links)
        if ",".join(mesh_dims) in named:
            return named[",".join(mesh_dims)]
        links = [named.get(m, self.link) for m in mesh_dims] or [self.link]
        return Link(max(x.latency_s for x in links), min(x.bandwidth for x in links))

    def to_json(self) -> dict:
        d = dataclasses.asdict(self)
        d["links"] = {m: dataclasses.asdict(x) for m, x in self.links}
        return d

    @staticmethod
    def from_json(d: dict) -> Device:
        return Device(
            name=str(d["name"]),
            matmul_flops=float(d["matmul_flops"]),
            vector_flops=float(d["vector_flops"]),
            memory_bytes=int(d["memory_bytes"]),
            link=Link(**d["link"]),
            links=tuple((m, Link(**x)) for m, x in d.get("links", {}).items()),
        )


# Published peaks (float32-in-bfloat16 matmul units where the chip has them), HBM and ICI/NVLink
# per-device bandwidth; latencies are typical measured collective start-up times.
KNOWN_DEVICES: dict[str, Device] = {
    "h100": Device("NVIDIA H100 SXM", 989e12, 33e12, 80 * GB, Link(10e-6, 450e9)),
    "a100": Device("NVIDIA A100 SXM", 312e12, 19.5e12, 80 * GB, Link(10e-6, 300e9)),
    "tpu-v3": Device("TPU v3 core", 61.5e12, 4e12, 16 * GB, Link(10e-6, 80e9)),
    "tpu-v4": Device("TPU v4", 275e12, 10e12, 32 * GB, Link(10e-6, 270e9)),
    "tpu-v5e": Device("TPU v5e", 197e12, 8e12, 16 * GB, Link(10e-6, 200e9)),
    "cpu": Device("CPU (virtual devices)", 20e9, 2e9, 4 * GB, Link(15e-6, 1.5e9)),
}


def load_device(spec: str | Device | None) -> Device:
    """A Device from a known name (`KNOWN_DEVICES`), a JSON file `meshax calibrate` wrote, or
    None: the calibration file in $MESHAX_DEVICE if set, else the local CPU's table entry."""
    if isinstance(spec, Device):
        return spec
    where = ""
    if spec is None:
        spec = os.environ.get("MESHAX_DEVICE") or "cpu"
        where = " (from $MESHAX_DEVICE)" if os.environ.get("MESHAX_DEVICE") else ""
    if spec.lower() in KNOWN_DEVICES:
        return KNOWN_DEVICES[spec.lower()]
    if not os.path.isfile(spec):
        raise ConfigError(
            f"device {spec!r}{where} is neither a known device ({', '.join(KNOWN_DEVICES)}) nor a file: "
            "name one, or measure the devices at hand with `meshax calibrate --out FILE`"
        )
    try:
        with open(spec) as f:
            return Device.from_json(json.load(f))
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        why = f"it has no field {e}" if isinstance(e, KeyError) else str(e) or type(e).__name__
        raise ConfigError(f"device file {spec!r} is not one `meshax calibrate` wrote ({why})") from None


def _seconds(fn, *args, repeats: int = 5) -> float:
    """The median wall time of fn(*args), compiled and warmed up first."""
    import jax

    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t)
    return sorted(times)[len(times) // 2]


def calibrate(mesh_shape, name: str = "", matmul_size: int = 512, message_bytes: int = 1 << 22) -> Device:
    """Measure the devices of the mesh as they run together: per-device matmul and elementwise
    throughput (every device computing at once, as in a step), and per mesh dim and group of
    mesh dims the latency
    and bandwidth of its links from allreduces timed inside one program (no launch cost): the
    latency from 4 bytes, the bandwidth from the slope of the time over messages up to
    `message_bytes`, by the ring's 2(n-1) latency + 2(n-1)/n bytes / bandwidth."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from meshax.layout import convert_to_mesh_shape

    shape = convert_to_mesh_shape(mesh_shape)
    names = tuple(shape.dimension_names)
    if shape.size == 1:  # (its device would move data for free: a search would cost no collective)
        raise ConfigError(
            f"mesh {mesh_shape!r} has one device, and calibrate measures the links between devices too: give a "
            "mesh of 2 or more (on a CPU, of virtual devices, e.g. 'all:8'), or search with a known device "
            f"(--device {', '.join(KNOWN_DEVICES)})"
        )
    if jax.device_count() < shape.size:
        raise ConfigError(f"mesh {mesh_shape!r} needs {shape.size} devices; this process has {jax.device_count()}")
    mesh = jax.make_mesh(tuple(shape.to_integer_list), names, devices=jax.devices()[: shape.size])
    n = matmul_size

    from meshax.lower.mesh_impl import jit_for_platform

    def local(f):  # compiled as meshax compiles its programs (cuBLAS matmuls on GPUs)
        return jit_for_platform(jax.shard_map(f, mesh=mesh, in_specs=P(names), out_specs=P(names), check_vma=False))

    def ones(*dims):  # each device's block along the first dim
        return jax.device_put(jnp.ones((shape.size * dims[0], *dims[1:]), jnp.float32), NamedSharding(mesh, P(names)))

    matmul = local(lambda x: x @ x[:, :n])
    matmul_flops = 2 * n**3 / _seconds(matmul, ones(n, n))
    v = ones(1 << 20)
    steps = 8
    vector = local(lambda x: jax.lax.fori_loop(0, steps, lambda i, y: y * 1.0001 + 0.5, x))
    vector_flops = 2 * steps * (1 << 20) / _seconds(vector, v)
    links = []
    groups = [g for r in range(1, len(names) + 1) for g in itertools.combinations(names, r)]
    for group in groups:  # each mesh dim, and each group of them a collective may run over together
        n = math.prod(shape.get_dim_by_name(m).size for m in group)
        if n == 1:
            continue
        ring = 2 * (n - 1)

        def per_psum(words: int, group=group) -> float:  # one allreduce inside a program: no launch cost
            def chain(k):
                return local(lambda x: jax.lax.fori_loop(0, k, lambda i, y: jax.lax.psum(y, group) * 0.5, x))

            x = ones(words)
            return max(_seconds(chain(17), x, repeats=9) - _seconds(chain(1), x, repeats=9), 1e-9) / 16

        # t = ring x latency + ring / n x bytes / bandwidth: the latency from 4 bytes, the
        # bandwidth from the slope fitted over larger messages
        sizes = [message_bytes // 16, message_bytes // 4, message_bytes]
        latency = per_psum(1) / ring
        slope = np.polyfit(np.array(sizes, float), np.array([per_psum(b // 4) for b in sizes]), 1)[0]
        bandwidth = ring / n / max(float(slope), 1e-15)
        links.append((",".join(group), Link(latency, bandwidth)))
    stats = jax.devices()[0].memory_stats() or {}
    memory = int(stats.get("bytes_limit", 0)) or int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    if jax.devices()[0].platform == "cpu":
        memory //= shape.size  # virtual devices share the host's memory
    measured = [x for m, x in links if "," not in m] or [Link(0.0, 1e12)]
    mean = Link(float(np.mean([x.latency_s for x in measured])), float(np.mean([x.bandwidth for x in measured])))
    name = name or f"{jax.devices()[0].device_kind} (calibrated on {mesh_shape})"
    return Device(name, matmul_flops, vector_flops, memory, mean, tuple(links))
