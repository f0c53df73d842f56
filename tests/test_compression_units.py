"""Gradient compression without a process group: quantizer, controller, config and the hook's state.

Every check here runs in one process (no ``torch.distributed``); the collectives
themselves are covered by the multi-process tests.
"""

from __future__ import annotations

import io
import itertools
import math
import pickle
import random
import threading

import pytest
import torch
import yaml

from het_strategy.compression.torch_codecs import wire_bytes
from het_strategy.compression.config import CompressionConfig, compression_config
from het_strategy.compression.controller import LayerOption, LinkModel, fit_link, predicted_exchange_s, \
    solve_layer_methods
from het_strategy.compression.state import CompressionState
from het_strategy.compression.quantize import QuantizerSpec, dequantize, error_bound, pack_codes, quantize, \
    unpack_codes, zero_padded
from het_strategy.core.codecs import Codec, CodecParams, packed_bytes
from het_strategy.core.errors import ConfigError
from het_strategy.core.shipped import shipped_config_dir

_COMPRESSION_DIR = shipped_config_dir("compression")


def _gradient_with_outliers(bucket: int, rows: int, seed: int) -> torch.Tensor:
    """Random rows of very different scales, a few large outliers, one constant row and one all-zero row."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, bucket, generator=g) * torch.logspace(-4, 2, rows).unsqueeze(1)
    hits = torch.randint(0, rows * bucket, (rows,), generator=g)
    x.view(-1)[hits] *= 1000.0  # outliers: each spoils only its own row's scale
    x[1] = 3.25  # constant row: max-min's step is 0
    x[2] = 0.0  # all-zero row: max-norm's scale is 0
    return x.reshape(-1)


# -- quantize.py -------------------------------------------------------------------------------------

@pytest.mark.parametrize("bits", range(2, 9))
def test_pack_unpack_round_trips_and_packs_densely(bits: int) -> None:
    g = torch.Generator().manual_seed(bits)
    n = 8 * 517
    codes = torch.randint(0, 2 ** bits, (n,), generator=g, dtype=torch.int64).to(torch.uint8)
    packed = pack_codes(codes, bits)
    assert packed.dtype == torch.uint8
    assert packed.numel() == n * bits // 8
    assert torch.equal(unpack_codes(packed, bits), codes)
    # the extreme codes survive too (the top bit of the last code in each 8-group)
    extremes = torch.tensor([0, 2 ** bits - 1] * 4, dtype=torch.uint8)
    assert torch.equal(unpack_codes(pack_codes(extremes, bits), bits), extremes)


@pytest.mark.parametrize("stochastic", [False, True])
@pytest.mark.parametrize("scaling", ["maxmin", "maxnorm"])
@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_quantization_error_is_within_the_bound(bits: int, scaling: str, stochastic: bool) -> None:
    spec = QuantizerSpec(bits=bits, scaling=scaling, bucket_size=64, stochastic=stochastic)
    x = _gradient_with_outliers(spec.bucket_size, rows=40, seed=bits)
    q = quantize(x, spec, torch.Generator().manual_seed(7))
    assert q.codes.dtype == torch.uint8 and q.codes.numel() == x.numel()
    assert int(q.codes.max()) < spec.levels
    assert q.meta.shape == (x.numel() // spec.bucket_size, spec.meta_floats)
    got = dequantize(q, spec)
    err = (got - x).abs()
    bound = error_bound(x, spec)
    worst = int((err - bound).argmax())
    assert bool((err <= bound).all()), f"element {worst}: error {err[worst]} > bound {bound[worst]}"
    rows = got.reshape(-1, spec.bucket_size)
    if scaling == "maxmin":  # a constant row is its own minimum: sent exactly
        assert torch.equal(rows[1], torch.full_like(rows[1], 3.25))
    assert torch.equal(rows[2], torch.zeros_like(rows[2]))  # zero stays exactly zero
    # the bound is not vacuous: it is of the order of the error on a typical row
    assert float(err.max()) > 0


def test_error_bound_halves_with_each_extra_bit() -> None:
    x = _gradient_with_outliers(128, rows=8, seed=3)
    wide = error_bound(x, QuantizerSpec(bits=3))
    narrow = error_bound(x, QuantizerSpec(bits=4))
    # maxmin step (max-min)/(2^b-1): 7 levels vs 15 levels, slack aside
    rows = slice(3 * 128, None)
    ratio = (wide[rows] / narrow[rows])
    assert torch.allclose(ratio, torch.full_like(ratio, 15 / 7), rtol=1e-4)


@pytest.mark.parametrize("scaling", ["maxmin", "maxnorm"])
def test_stochastic_rounding_is_unbiased(scaling: str) -> None:
    bucket, draws = 64, 4000
    g = torch.Generator().manual_seed(11)
    x = torch.randn(bucket, generator=g)
    spec = QuantizerSpec(bits=2, scaling=scaling, bucket_size=bucket, stochastic=True)
    # each copy of x is its own row with the same scale: one call gives `draws` independent draws
    repeated = x.repeat(draws)
    got = dequantize(quantize(repeated, spec, torch.Generator().manual_seed(12)), spec).reshape(draws, bucket)
    step = float(error_bound(x, spec)[0])  # stochastic bound: one step (plus a few ulps)
    # each draw is one of two levels a step apart: std <= step/2
    standard_error = step / 2 / math.sqrt(draws)
    mean_error = (got.mean(dim=0) - x).abs()
    assert float(mean_error.max()) <= 5 * standard_error, (float(mean_error.max()), standard_error)
    # the same tolerance catches round-to-nearest's bias, so the check above can fail
    nearest = QuantizerSpec(bits=2, scaling=scaling, bucket_size=bucket, stochastic=False)
    biased = (dequantize(quantize(x, nearest), nearest) - x).abs()
    assert float(biased.max()) > 5 * standard_error


@pytest.mark.parametrize("scaling", ["maxmin", "maxnorm"])
@pytest.mark.parametrize("bits", [2, 3, 4, 5, 8])
def test_packed_bytes_counts_codes_and_metadata(bits: int, scaling: str) -> None:
    spec = QuantizerSpec(bits=bits, scaling=scaling, bucket_size=32)
    x = torch.randn(32 * 9, generator=torch.Generator().manual_seed(bits))
    q = quantize(x, spec)
    actual = pack_codes(q.codes, bits).numel() * 1 + q.meta.numel() * 4  # uint8 codes, fp32 metadata
    assert packed_bytes(x.numel(), bits, CodecParams(bucket_size=32, scaling=scaling)) == actual
    assert actual == 9 * (32 * bits // 8 + 4 * (2 if scaling == "maxmin" else 1))


def test_zero_padded_fills_whole_buckets_and_keeps_a_whole_fp32_tensor() -> None:
    x = torch.arange(1.0, 11.0)
    padded = zero_padded(x, 8)
    assert padded.tolist() == [*x.tolist(), 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    assert zero_padded(padded, 8) is padded  # already whole: no copy
    half = torch.ones(16, dtype=torch.bfloat16)
    assert zero_padded(half, 8).dtype == torch.float32  # always fp32, whole or not


# -- controller.py -----------------------------------------------------------------------------------

def _bins(error: float, budget: float, resolution: int) -> int:
    """The controller's documented discretisation: errors rounded up to whole bins."""
    return math.ceil(error / budget * resolution - 1e-9) if error > 0 else 0


def _random_instance(rng: random.Random) -> tuple[list[list[LayerOption]], float]:
    tokens = ["none", "q8", "q4", "q2"]
    options = []
    for _ in range(rng.randint(2, 5)):
        k = rng.randint(2, 4)
        row = [LayerOption("none", rng.uniform(0.5, 2.0), 0.0)]
        row += [LayerOption(tokens[i], rng.uniform(0.0, 1.5), rng.uniform(0.01, 1.0)) for i in range(1, k)]
        options.append(row)
    return options, rng.uniform(0.1, 2.5)


def test_solve_layer_methods_matches_brute_force() -> None:
    rng = random.Random(2024)
    binding = 0
    for case in range(200):
        options, budget = _random_instance(rng)
        resolution = (2000, 100, 17)[case % 3]
        best_time, unconstrained = math.inf, math.inf
        for combo in itertools.product(*(range(len(o)) for o in options)):
            time_s = sum(options[layer][i].time_s for layer, i in enumerate(combo))
            unconstrained = min(unconstrained, time_s)
            if sum(_bins(options[layer][i].error, budget, resolution) for layer, i in enumerate(combo)) \
                    <= resolution:
                best_time = min(best_time, time_s)
        chosen = solve_layer_methods(options, budget, resolution=resolution)
        assert len(chosen) == len(options)
        picked = [options[layer][i] for layer, i in enumerate(chosen)]
        assert sum(o.error for o in picked) <= budget, (case, chosen, budget)
        assert abs(sum(o.time_s for o in picked) - best_time) <= 1e-12, (case, chosen, best_time)
        binding += best_time > unconstrained
    # the budget must actually constrain a good share of the instances, or the check above is weak
    assert binding >= 40, binding


def test_solve_layer_methods_edge_cases() -> None:
    assert solve_layer_methods([], 1.0) == []
    # a zero budget allows only error-free options
    opts = [[LayerOption("none", 1.0, 0.0), LayerOption("q4", 0.1, 0.5)]] * 3
    assert solve_layer_methods(opts, 0.0) == [0, 0, 0]
    # a generous budget lets every layer take the fastest option
    assert solve_layer_methods(opts, 10.0) == [1, 1, 1]
    # room for exactly two of the three compressed layers
    assert sorted(solve_layer_methods(opts, 1.0)) == [0, 1, 1]


def _link_options(link: LinkModel, shapes: list[tuple[int, ...]], config: CompressionConfig, world: int,
                  codec_s: float) -> list[list[LayerOption]]:
    errors = {"none": 0.0, "q8": 0.01, "q4": 1.0, "q3": 2.0, "q2": 4.0}
    return [[LayerOption(t, link.transfer_s(wire_bytes(t, s, world, config)) + (0.0 if t == "none" else codec_s),
                         errors[t]) for t in config.candidates] for s in shapes]


def test_a_fast_link_switches_compression_off_and_a_slow_one_on() -> None:
    config = CompressionConfig()
    shapes = [(256, 256), (512, 128), (1024, 64)]
    budget = 1.0 * len(shapes)  # uniform q4's error
    fast = _link_options(LinkModel(1e-5, 1e12), shapes, config, world=4, codec_s=1e-3)
    assert [config.candidates[i] for i in solve_layer_methods(fast, budget)] == ["none"] * 3
    slow = _link_options(LinkModel(1e-3, 1e7), shapes, config, world=4, codec_s=1e-3)
    tokens = [config.candidates[i] for i in solve_layer_methods(slow, budget)]
    assert "none" not in tokens and sum({"q8": 0.01, "q4": 1.0, "q3": 2.0, "q2": 4.0}[t] for t in tokens) <= budget


def test_wire_bytes_formulas() -> None:
    config = CompressionConfig(rank=4, topk_ratio=0.01)
    shape, n, world = (256, 256), 256 * 256, 4
    none = wire_bytes("none", shape, world, config)
    assert none == int(2 * (world - 1) / world * 4 * n) == 393216
    assert wire_bytes("none", shape, world, config, "bf16") == none // 2  # bf16 gradients go as they are
    assert wire_bytes("fp16", shape, world, config) == none // 2
    assert wire_bytes("bf16", shape, world, config) == none // 2
    q4 = wire_bytes("q4", shape, world, config)
    assert none / q4 >= 7, none / q4
    # two phases of (W-1) chunks of n/W elements: 4-bit codes plus min and step per bucket_size elements
    assert q4 == 2 * (world - 1) * (n // world * 4 // 8 + n // world // config.bucket_size * 8)
    assert wire_bytes("q8", shape, world, config) > q4 > wire_bytes("q2", shape, world, config)
    # PowerSGD: P (rows x r) and Q (cols x r), each allreduced in fp32
    assert wire_bytes("powersgd", shape, world, config) == int(1.5 * 4 * 4 * (256 + 256))
    conv = (64, 3, 3, 3)  # a conv weight is a 64 x 27 matrix
    assert wire_bytes("powersgd", conv, world, config) == int(1.5 * 4 * 4 * (64 + 27))
    # a matrix the factors would not shrink goes whole, as torch's hook sends it: (8 + 2) x 2 > 16
    assert wire_bytes("powersgd", (8, 2), 2, config) == int(1.0 * 4 * 8 * 2)
    assert wire_bytes("powersgd", (64, 8), 2, config) == int(1.0 * 4 * 4 * (64 + 8))  # (64 + 8) x 4 < 512
    # top-k: every other rank receives k (fp32 value, int32 index) pairs
    assert wire_bytes("topk", shape, world, config) == (world - 1) * 8 * math.ceil(0.01 * n)
    assert wire_bytes("topk", (3, 3), world, config) == (world - 1) * 8  # at least one entry
    with pytest.raises(ValueError, match="gzip"):
        wire_bytes("gzip", shape, world, config)


def test_predicted_exchange_counts_a_latency_per_collective() -> None:
    """One allreduce per bucket; each compressed method group within a bucket adds two collectives."""
    options = [[LayerOption("none", 1.0, 0.0), LayerOption("q4", 0.2, 1.0)] for _ in range(3)]
    buckets = [0, 0, 1]
    assert predicted_exchange_s(options, [0, 0, 0], buckets, 0.5) == pytest.approx(3.0 + 2 * 0.5)
    # layers 0 and 1 share bucket 0's q4 group: one group, two extra collectives
    assert predicted_exchange_s(options, [1, 1, 0], buckets, 0.5) == pytest.approx(1.4 + (2 + 2) * 0.5)
    assert predicted_exchange_s(options, [1, 1, 1], buckets, 0.5) == pytest.approx(0.6 + (2 + 4) * 0.5)


def test_fit_link_recovers_latency_and_bandwidth() -> None:
    latency, rate = 2.5e-4, 1.25e9
    sizes = [1e4, 3e5, 4e6, 2e7]
    fitted = fit_link(sizes, [latency + s / rate for s in sizes])
    assert fitted.latency_s == pytest.approx(latency, rel=1e-6)
    assert fitted.bytes_per_s == pytest.approx(rate, rel=1e-9)
    # two points determine the line exactly too
    two = fit_link([1e5, 1e6], [latency + 1e5 / rate, latency + 1e6 / rate])
    assert two.latency_s == pytest.approx(latency, rel=1e-6) and two.bytes_per_s == pytest.approx(rate, rel=1e-9)


# -- config.py ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("field, value, shown", [
    ("bits", 1, "1"), ("bits", 33, "33"), ("bits", True, "True"),
    ("rank", 0, "0"), ("method", "gzip", "'gzip'"),
    ("error_budget", 0, "0"), ("error_budget", -1, "-1"), ("error_budget", float("nan"), "nan"),
    ("bucket_size", 12, "12"), ("topk_ratio", 0, "0"), ("topk_ratio", 1, "1"),
    ("candidates", ["q9"], "'q9'"), ("candidates", [], "[]"),
    ("min_saving", 1, "1"), ("min_saving", -0.1, "-0.1"), ("link_mbit", 0, "0"),
])
def test_bad_config_names_the_field_and_the_value(field: str, value: object, shown: str) -> None:
    with pytest.raises(ConfigError) as info:
        CompressionConfig(**{field: value})
    message = str(info.value)
    assert f"`compression.{field}" in message, message
    assert f" is {shown};" in message, message


def test_compression_config_sources() -> None:
    q4 = compression_config("q4")
    assert q4.method is Codec.Q4 and q4.to_dict()["method"] == "q4" and type(q4.to_dict()["method"]) is str
    assert compression_config("adaptive") == CompressionConfig(method="adaptive")
    assert compression_config(None) is None
    given = CompressionConfig(method="topk")
    assert compression_config(given) is given
    mapped = compression_config({"_target_": "ignored.Thing", "description": "ignored", "method": "q3",
                                 "candidates": ["none", "q3"]})
    assert mapped == CompressionConfig(method="q3", candidates=(Codec.NONE, Codec.Q3))
    assert all(type(t) is Codec for t in mapped.candidates)
    with pytest.raises(ConfigError) as info:
        compression_config({"method": "q3", "bitz": 3})
    assert "compression.bitz" in str(info.value) and "unknown key" in str(info.value)
    with pytest.raises(ConfigError, match="compression.method"):
        compression_config("gzip")
    with pytest.raises(ConfigError, match="compression"):
        compression_config(4)


def test_a_codec_has_one_spelling_and_bits_alone_is_no_codec() -> None:
    with pytest.raises(ConfigError) as info:  # 0.1.0's `method: quantize` + `bits` is refused like any unknown method
        compression_config({"method": "quantize", "bits": 8, "warmup_steps": 1})
    message = str(info.value)
    assert message.startswith("`compression.method` is 'quantize'; it must be one of adaptive, none, fp16") \
        and "q8" in message and "\n" not in message
    assert compression_config({"method": "q8", "warmup_steps": 1}).method is Codec.Q8
    with pytest.raises(ConfigError, match=r"`compression.bits` is 8; it must be left out with method q4 .*method: q8"):
        CompressionConfig(method="q4", bits=8)  # bits alone would not change the codec


def test_every_shipped_compression_config_loads() -> None:
    # planned.yaml asks for the plan's choice (resolved by the training job), not a CompressionConfig itself
    paths = sorted(p for p in _COMPRESSION_DIR.glob("*.yaml") if p.stem != "planned")
    assert {p.stem for p in paths} >= {"none", "adaptive", "q4", "powersgd", "topk", "fp16", "bf16"}
    loaded = {p.stem: compression_config(yaml.safe_load(p.read_text())) for p in paths}
    assert all(isinstance(c, CompressionConfig) for c in loaded.values())
    # a shipped option named for a codec runs that codec: one spelling for both
    assert all(c.method == p for p, c in loaded.items() if p in {t.value for t in Codec})
    assert loaded["adaptive"].method == "adaptive"
    assert loaded["topk"].topk_ratio == 0.01


# -- state.py (no process group) ---------------------------------------------------------------------

def _busy_state() -> CompressionState:
    """A state that has been somewhere: steps counted, a choice, residuals, a fitted link, a log."""
    state = CompressionState(torch.nn.Linear(64, 64), "adaptive")
    state.step = 37
    state.choices = {"weight": "q3"}
    state.controller.next_solve = 87
    state.controller.interval = 100
    state.residuals = {"weight": torch.randn(64 * 64, generator=torch.Generator().manual_seed(5))}
    state.controller.link = LinkModel(1e-4, 1.5e8)
    state.decisions = [{"step": 10, "layer": "weight", "method": "q3", "bits_per_element": 3.5,
                        "bytes_per_rank": 1234, "error": 0.5}]
    state.bytes_sent = 1000
    state.bytes_fp32 = 8000
    return state


def _assert_same_state(a: CompressionState, b: CompressionState) -> None:
    assert a.config == b.config
    for name in ("step", "choices", "decisions", "bytes_sent", "bytes_fp32"):
        assert getattr(a, name) == getattr(b, name), name
    for name in ("next_solve", "interval", "link"):
        assert getattr(a.controller, name) == getattr(b.controller, name), name
    assert a.residuals.keys() == b.residuals.keys()
    for key in a.residuals:
        assert torch.equal(a.residuals[key], b.residuals[key])


def test_state_dict_survives_torch_save_and_load() -> None:
    state = _busy_state()
    buffer = io.BytesIO()
    torch.save(state.state_dict(), buffer)
    buffer.seek(0)
    restored = CompressionState(torch.nn.Linear(64, 64), "adaptive")
    restored.load_state_dict(torch.load(buffer, weights_only=False))
    _assert_same_state(state, restored)
    assert restored.wire_ratio == 8.0


def test_state_pickles_without_its_process_group() -> None:
    state = _busy_state()
    state.process_group = threading.Lock()  # stands in for a ProcessGroup: not picklable
    with pytest.raises(TypeError):
        pickle.dumps(state.process_group)
    clone = pickle.loads(pickle.dumps(state))
    assert clone.process_group is None
    _assert_same_state(state, clone)


def test_only_an_adaptive_state_has_a_controller_and_every_method_saves_the_same_keys() -> None:
    adaptive = CompressionState(torch.nn.Linear(64, 64), {"method": "adaptive", "warmup_steps": 7})
    controller = adaptive.controller
    assert controller is not None and controller.config is adaptive.config
    assert (controller.next_solve, controller.interval, controller.link) == (7, 50, None)
    uniform = CompressionState(torch.nn.Linear(64, 64), {"method": "q4", "warmup_steps": 7})
    assert uniform.controller is None
    assert not hasattr(uniform, "next_solve")  # the schedule is the controller's alone
    saved = uniform.state_dict()
    assert saved.keys() == adaptive.state_dict().keys()
    assert (saved["next_solve"], saved["interval"], saved["link"]) == (7, 50, None)  # a fresh controller's


class _NetHolder(torch.nn.Module):
    """Parameter names of the 0.1.0 fixture's model: ``net.0.weight`` ..."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1)).double()


def test_a_0_1_0_checkpoints_compression_states_load_and_save_back_unchanged_in_todays_spelling() -> None:
    """0.1.0 saved its config as ``method: quantize`` + ``bits: 8``, a spelling refused now (the strategy refuses a
    0.1.0 checkpoint as a whole: it has no checkpoint format); with the config as ``q8`` the rest of the state
    loads and saves back unchanged."""
    from pathlib import Path

    ckpt = torch.load(Path(__file__).parent / "data" / "checkpoint_v0.1.0.ckpt", weights_only=False)
    ranks = ckpt["het_strategy"]["compression"]["ranks"]
    for saved in ranks:
        state = CompressionState(_NetHolder(), {"method": "q8", "min_numel": 8, "warmup_steps": 1})
        with pytest.raises(ConfigError, match="`compression.method` is 'quantize'; it must be one of adaptive"):
            state.load_state_dict(saved)
        saved = {**saved, "config": state.config.to_dict()}
        state.load_state_dict(saved)
        again = state.state_dict()
        assert again.keys() == saved.keys()
        for key in ("step", "choices", "next_solve", "interval", "link", "decisions", "bytes_sent", "bytes_fp32"):
            assert again[key] == saved[key], key
        for key in ("residuals", "chunk_residuals"):
            assert again[key].keys() == saved[key].keys()
            assert all(torch.equal(again[key][n], saved[key][n]) for n in saved[key])
        assert torch.equal(again["generator"], saved["generator"])


def test_compression_modules_import_one_way() -> None:
    """quantize <- config <- torch_codecs <- exchange, controller <- adaptive <- state <- hook: no module imports one
    that imports it back (TYPE_CHECKING and function-level imports included)."""
    import ast
    from pathlib import Path

    import het_strategy.compression as package

    root = Path(package.__file__).parent
    graph: dict[str, set[str]] = {}
    for path in root.glob("*.py"):
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            modules = [node.module or ""] if isinstance(node, ast.ImportFrom) else \
                [a.name for a in node.names] if isinstance(node, ast.Import) else []
            deps |= {m.split(".")[2] for m in modules if m.startswith("het_strategy.compression.")}
        graph[path.stem] = deps - {path.stem}

    def reaches(start: str, goal: str, seen: set[str]) -> bool:
        return any(d == goal or (d not in seen and reaches(d, goal, seen | {d})) for d in graph.get(start, ()))

    assert not [m for m in graph if reaches(m, m, {m})]
    assert graph["adaptive"] <= {"config", "quantize", "torch_codecs", "exchange", "controller"}
    assert "hook" not in graph["state"] and "state" not in graph["adaptive"]


def test_load_state_dict_rejects_another_version() -> None:
    saved = _busy_state().state_dict()
    saved["version"] = 99
    with pytest.raises(ConfigError, match="version"):
        CompressionState(torch.nn.Linear(64, 64)).load_state_dict(saved)


def test_state_needs_a_module() -> None:
    with pytest.raises(ConfigError) as info:
        CompressionState({"weight": torch.zeros(4)}, "adaptive")  # type: ignore[arg-type]
    assert "`module`" in str(info.value) and "dict" in str(info.value)


def test_small_and_one_dimensional_tensors_are_not_eligible() -> None:
    linear = torch.nn.Linear(64, 64)
    state = CompressionState(linear, CompressionConfig(method="q4", warmup_steps=0))
    assert state.eligible(linear.weight)  # 4096 elements >= min_numel 1024
    assert not state.eligible(linear.bias)  # 1-D
    assert not state.eligible(torch.zeros(4096))  # 1-D however large
    assert not state.eligible(torch.zeros(16, 16))  # 256 < 1024
    assert state.eligible(torch.zeros(32, 32))  # exactly min_numel
    assert state.token_for("weight", linear.weight) == "q4"
    assert state.token_for("bias", linear.bias) == "none"


def test_compression_monitor_logs_the_saving_and_each_new_decision_once() -> None:
    from het_strategy.callbacks.compression import CompressionMonitor

    state = CompressionState(torch.nn.Linear(64, 64), "adaptive")
    state.bytes_fp32, state.bytes_sent = 800, 100
    state.decisions = [{"step": 10, "layer": "weight", "bits_per_element": 4.25}]
    monitor = CompressionMonitor(every_n_steps=5)
    totals = {"compression/raw_bytes_total": 800.0, "compression/wire_bytes_total": 100.0}
    assert monitor.metrics(state, 10) == {"compression/wire_ratio": 8.0, "compression/bits/weight": 4.25, **totals}
    assert monitor.metrics(state, 11) == {}  # nothing due, nothing new
    state.decisions.append({"step": 60, "layer": "weight", "bits_per_element": 32.0})
    assert monitor.metrics(state, 61) == {"compression/bits/weight": 32.0, "compression/wire_ratio": 8.0, **totals}
    with pytest.raises(ConfigError, match="every_n_steps"):
        CompressionMonitor(every_n_steps=0)
