"""The compiled partition (protocol/codec/_kernels.c) against the numpy path and the definition.

Both paths must give the same classes, the same stable partition and the same payload bytes: the
kernels are a speed-up, never a format. `make test` builds them, so a missing build fails here."""

from __future__ import annotations

import numpy as np
import pytest

from asyncrl.protocol.codec import DELTA_CODEC, decode, encode_delta
from asyncrl.protocol.codec import format as codec_format
from asyncrl.protocol.codec import planes as codec_planes

from .test_codec import CAP, lora_like

PATHS = ["numpy", "compiled"]


def select(monkeypatch, name: str) -> None:
    """Run the codec on one path until the test ends (monkeypatch restores the build's choice)."""
    monkeypatch.setattr(codec_planes, "KERNELS", None)
    if name == "compiled":
        codec_planes.use_kernels(True)


@pytest.fixture(params=PATHS)
def path(request, monkeypatch):
    select(monkeypatch, request.param)
    return request.param


def test_the_compiled_kernels_are_built():
    from asyncrl.protocol.codec import _kernels  # noqa: F401  (setup.py; an ImportError here = no build)

    assert codec_planes.KERNELS is not None


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
@pytest.mark.parametrize("nbounds", [0, 1, 3, 6, 15])
def test_partition_and_inverse_match_the_definition(path, dtype, nbounds):
    dt = codec_format.DTYPES[dtype]
    rng = np.random.default_rng(nbounds)
    sizes = [codec_planes.CLASS_CHUNK + 17, 3, 0, 40_000]  # several tensors, one longer than a chunk
    parents = [rng.integers(0, 1 << dt.bits, n, dtype=np.uint64).astype(dt.word) for n in sizes]
    bounds = sorted(rng.choice(np.arange(1, 255), nbounds, replace=False).tolist())
    cls = codec_planes.class_ids(parents, bounds, dt)
    everything = np.concatenate(parents)
    exp = (everything >> everything.dtype.type(dt.mant_bits)) & everything.dtype.type(dt.exp_mask)
    want = np.zeros(everything.size, np.uint8)
    for b in bounds:
        want += (exp >= b).astype(np.uint8)
    assert np.array_equal(cls, want)

    w = rng.integers(0, 1 << dt.bits, everything.size, dtype=np.uint64).astype(dt.word)
    streams = codec_planes.gather_classes(w, cls, nbounds + 1)
    for k, stream in enumerate(streams):
        assert np.array_equal(stream, w[want == k])  # class k's members, in their original order
    out = np.empty_like(w)
    assert codec_planes.scatter_classes(out, cls, streams) and np.array_equal(out, w)
    zz = np.empty_like(w)  # the delta decoder's form: zigzag-decoded in the same pass
    assert codec_planes.scatter_classes(zz, cls, streams, unzigzag=True)
    assert np.array_equal(zz, codec_planes.unzigzag_inplace(w.copy()))
    if nbounds:  # streams that do not fit the classes are refused, never read out of range
        for bad in ([streams[0][:-1], *streams[1:]], [np.append(streams[0], 7).astype(dt.word), *streams[1:]]):
            assert not codec_planes.scatter_classes(np.empty_like(w), cls, bad)


def test_a_class_beyond_the_streams_is_refused(path):
    cls = np.array([0, 1, 2, 1], np.uint8)  # a parent with a class the payload has no stream for
    streams = [np.array([5], "<u2"), np.array([6, 7], "<u2")]
    assert not codec_planes.scatter_classes(np.empty(4, "<u2"), cls, streams)


def test_kernel_partition_checks_sizes_before_writing():
    k = codec_planes.KERNELS
    assert k is not None
    w = np.arange(6, dtype="<u2")
    cls = np.array([0, 1, 0, 1, 1, 0], np.uint8)
    outs = [np.full(2, 9, "<u2"), np.full(3, 9, "<u2")]  # class 0 has 3 members, not 2
    with pytest.raises(ValueError):
        k.partition(w, cls, outs)
    assert all((o == 9).all() for o in outs)  # nothing written
    with pytest.raises(ValueError):
        k.partition(w, cls, [np.empty(3, "<u4"), np.empty(3, "<u4")])  # word sizes differ
    with pytest.raises(ValueError):
        k.partition(w, cls[:5], outs)  # classes of the wrong length
    assert not k.unpartition(np.empty(6, "<u2"), cls, [w[:3], w[:2]])  # class 1 has 3 members, not 2
    with pytest.raises(TypeError):
        k.unpartition(np.empty(6, "<u2"), cls.tolist(), [w])  # not a buffer


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_payloads_are_identical_with_and_without_the_kernels(dtype, monkeypatch):
    specs, versions = lora_like(11, steps=3)
    if dtype == "fp32":  # the same trajectory, widened (the low half moves like fp32 rounding noise)
        rng = np.random.default_rng(1)
        specs = [type(s)(name=s.name, dtype="fp32", shape=s.shape) for s in specs]
        versions = [{k: (np.frombuffer(v, "<u2").astype("<u4") << np.uint32(16)
                         | rng.integers(0, 1 << 16, len(v) // 2).astype("<u4")).tobytes() for k, v in ver.items()}
                    for ver in versions]
    payloads = {}
    for name in PATHS:
        select(monkeypatch, name)
        payloads[name] = [encode_delta(specs, versions[i + 1], versions[i]) for i in range(2)]
    assert payloads["numpy"] == payloads["compiled"]
    for name in PATHS:  # and each decoder reads them back
        select(monkeypatch, name)
        for i, payload in enumerate(payloads["numpy"]):
            assert decode(DELTA_CODEC, specs, payload, versions[i], max_raw_bytes=CAP) == versions[i + 1]


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
@pytest.mark.parametrize("layout", [codec_format.LAYOUT_BYTES, codec_format.LAYOUT_FIELDS])
@pytest.mark.parametrize("n", [0, 1, 7, 8, 9, 4099])  # whole blocks of 8 and tails of every length
def test_unpack_rebuilds_the_words_on_both_paths(path, dtype, layout, n):
    dt = codec_format.DTYPES[dtype]
    rng = np.random.default_rng(n)
    w = rng.integers(0, 1 << dt.bits, n, dtype=np.uint64).astype(dt.word)
    planes = [bytes(p) for p in codec_planes.pack(w, layout, dt)]
    assert [len(p) for p in planes] == codec_planes.plane_sizes(layout, n, dt)
    assert np.array_equal(codec_planes.unpack(planes, layout, n, dt), w)
    zz = codec_planes.unpack(planes, layout, n, dt, unzigzag=True)
    assert np.array_equal(zz, codec_planes.unzigzag_inplace(w.copy()))
    into = np.full(n + 2, 7, dt.word)  # written in place, nothing beside it touched
    codec_planes.unpack(planes, layout, n, dt, out=into[1 : n + 1])
    assert np.array_equal(into[1 : n + 1], w) and into[0] == 7 and into[-1] == 7


def test_kernel_unpack_checks_plane_sizes_before_writing():
    k = codec_planes.KERNELS
    assert k is not None
    dt = codec_format.DTYPES["bf16"]
    w = np.arange(20, dtype="<u2")
    planes = [bytes(p) for p in codec_planes.pack(w, codec_format.LAYOUT_FIELDS, dt)]
    out = np.full(20, 9, "<u2")
    for bad in (planes[:-1], [planes[0][:-1], *planes[1:]], [*planes[:-1], planes[-1] + b"x"]):
        with pytest.raises(ValueError):
            k.unpack(out, True, bad)
    assert (out == 9).all()  # nothing written
    with pytest.raises(ValueError):
        k.unpack(np.empty(20, np.uint8), False, [bytes(20)])  # words of one byte
