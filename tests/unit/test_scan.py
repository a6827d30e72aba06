"""``mechmon scan`` on synthetic checkpoints: exact spectra, TP merging, errors, safe loading,
detection on a crafted drift (no training framework needed)."""

from __future__ import annotations

import argparse
import os
import pickle

import pytest
import torch

from mechmon_megatron.cli import main
from mechmon_megatron.math.qk_grams import qk_grams, qk_spectra, term_rank_bound
from mechmon_megatron.math.spectra import spectral_metrics
from mechmon_megatron.scan import ScanError, scan

NP, NG, HN, D, LAYERS = 4, 2, 8, 32, 4
ARGS = argparse.Namespace(num_attention_heads=NP, num_query_groups=NG, group_query_attention=True,
                          hidden_size=D, kv_channels=HN, qk_layernorm=True, num_layers=LAYERS)
QKV = "decoder.layers.{}.self_attention.linear_qkv.weight"
QNORM = "decoder.layers.{}.self_attention.q_layernorm.weight"
KNORM = "decoder.layers.{}.self_attention.k_layernorm.weight"
ROUTER = "decoder.layers.{}.mlp.router.weight"
FC1 = "decoder.layers.{}.mlp.linear_fc1.weight"


def _weights(steps: list[int], drift_from: int | None = None, seed: int = 0,
             np_: int = NP, ng: int = NG) -> dict[int, dict[str, torch.Tensor]]:
    """A random walk of megatron-core tensors per step; from ``drift_from`` on, a coherent
    rank-1 update adds to the Q rows of head 1 in layer 2."""
    gen = torch.Generator().manual_seed(seed)
    rows = (np_ + 2 * ng) * HN
    state = {}
    for i in range(LAYERS):
        state[QKV.format(i)] = torch.randn(rows, D, generator=gen) * 0.3
        state[QNORM.format(i)] = 1 + 0.1 * torch.randn(HN, generator=gen)
        state[KNORM.format(i)] = 1 + 0.1 * torch.randn(HN, generator=gen)
        state[ROUTER.format(i)] = torch.randn(4, D, generator=gen)
        state[FC1.format(i)] = torch.randn(2 * D, D, generator=gen) * 0.1
    state["embedding.word_embeddings.weight"] = torch.randn(8, D, generator=gen)
    u, v = torch.randn(HN, generator=gen), torch.randn(D, generator=gen)
    out = {}
    for step in steps:
        state = {k: t + 0.01 * torch.randn(t.shape, generator=gen) for k, t in state.items()}
        if drift_from is not None and step >= drift_from:
            w = state[QKV.format(1)].clone()
            w[HN:2 * HN] += 0.05 * torch.outer(u, v)  # head 1 of group 0
            state[QKV.format(1)] = w
        out[step] = state
    return out


def _save_plain(directory, weights, args=ARGS) -> None:
    os.makedirs(directory, exist_ok=True)
    for step, sd in weights.items():
        torch.save({"model": sd, "args": args, "iteration": step},
                   os.path.join(directory, f"step_{step:05d}.pt"))


def _save_legacy(directory, weights, tp: int, args=ARGS) -> None:
    for step, sd in weights.items():
        for rank in range(tp):
            shard = {k: (t.chunk(tp, 0)[rank] if ("linear_qkv" in k or "fc1" in k) else t)
                     for k, t in sd.items()}
            path = os.path.join(directory, f"iter_{step:07d}", f"mp_rank_{rank:02d}")
            os.makedirs(path, exist_ok=True)
            torch.save({"model": shard, "args": args, "iteration": step},
                       os.path.join(path, "model_optim_rng.pt"))


def _reference_delta2(w0: dict, w1: dict, layer: int) -> dict[str, torch.Tensor]:
    """Per-head delta2 metrics of a layer computed here from the raw rows (LayerNorm folded)."""
    def rows(sd):
        blocks = sd[QKV.format(layer - 1)].view(NG, (NP // NG + 2) * HN, D)
        wq = blocks[:, :NP // NG * HN].reshape(NP, HN, D)
        wk = blocks[:, NP // NG * HN:(NP // NG + 1) * HN]
        fold = [(r - r.mean(1, keepdim=True)) * g.view(1, -1, 1) for r, g in
                ((wq, sd[QNORM.format(layer - 1)]), (wk, sd[KNORM.format(layer - 1)]))]
        return fold
    (q0, k0), (q1, k1) = rows(w0), rows(w1)
    sigma2 = qk_spectra(qk_grams(q0, q1, k0, k1), torch.arange(NP) // (NP // NG),
                        ("delta2",))["delta2"]
    return spectral_metrics(sigma2, term_rank_bound("delta2", HN, D))._asdict()


def _values(result, step: int, prefix: str) -> list[float]:
    row = next(r for r in result.rows if r["step"] == step)
    return [row["signals"][f"{prefix}/head_{h}"] for h in range(NP)]


def test_plain_state_dicts_give_the_exact_per_head_delta2_spectra(tmp_path):
    weights = _weights([100, 200, 300])
    _save_plain(tmp_path / "run", weights)
    result = scan(tmp_path / "run", progress=False, plots=False)
    assert [r["step"] for r in result.rows] == [200, 300]
    assert result.kind == "torch" and len(result.plan.routers) == LAYERS
    for layer in (1, 2):
        ref = _reference_delta2(weights[200], weights[300], layer)
        for metric in ("fro", "stable_rank", "entropy", "norm_entropy"):
            got = _values(result, 300, f"attn/delta2/{metric}/layer_{layer}")
            assert got == pytest.approx(ref[metric].tolist(), rel=1e-9)
    signals = result.rows[-1]["signals"]
    assert signals["attn/delta2/entropy/layer_1/min"] == min(
        _values(result, 300, "attn/delta2/entropy/layer_1"))
    w0, w1 = weights[200][FC1.format(0)], weights[300][FC1.format(0)]
    expected = float((w1 - w0).norm() / w0.norm())
    assert signals["optim/update_ratio_ckpt/mlp/layer_1"] == pytest.approx(expected, rel=1e-6)
    assert "router/weight_cosine/layer_2" in signals
    assert 0 < signals["attn/qk_coherence/layer_1"] < 2


@pytest.mark.parametrize("ng", [2, 1])
def test_legacy_tp2_shards_merge_to_the_tp1_result(tmp_path, ng):
    args = argparse.Namespace(**dict(vars(ARGS), num_query_groups=ng))
    weights = _weights([10, 20, 30], np_=NP, ng=ng)
    _save_plain(tmp_path / "tp1", weights, args)
    _save_legacy(tmp_path / "tp2", weights, 2, args)
    one = scan(tmp_path / "tp1", progress=False, plots=False, ratios=False)
    two = scan(tmp_path / "tp2", progress=False, plots=False, ratios=False)
    assert two.kind == "megatron_legacy"
    for a, b in zip(one.rows, two.rows, strict=True):
        heads = {k: v for k, v in a["signals"].items() if "/head_" in k}
        assert heads and heads == {k: b["signals"][k] for k in heads}


def _assert_refused(root, match: str, out) -> None:
    with pytest.raises(ScanError, match=match):
        scan(root, out=out, progress=False, plots=False)
    assert not os.path.exists(out)


def test_bad_input_is_named_and_nothing_is_written(tmp_path):
    out = tmp_path / "out"
    (tmp_path / "empty").mkdir()
    _assert_refused(tmp_path / "empty", "no checkpoints found", out)
    _save_plain(tmp_path / "one", _weights([5]))
    _assert_refused(tmp_path / "one", "only one checkpoint", out)
    no_qk = {s: {"mlp.fc.weight": sd[FC1.format(0)]} for s, sd in _weights([1, 2]).items()}
    _save_plain(tmp_path / "noqk", no_qk)
    _assert_refused(tmp_path / "noqk", "no attention Q/K tensors", out)
    mixed = _weights([1, 2, 3])
    mixed[3][FC1.format(0)] = torch.zeros(3, D)
    _save_plain(tmp_path / "mixed", mixed)
    _assert_refused(tmp_path / "mixed", r"mixed shapes: decoder.layers.0.mlp.linear_fc1.weight",
                    out)
    mla = {s: dict(sd, **{"model.layers.0.self_attn.q_a_proj.weight": torch.zeros(2, D)})
           for s, sd in _weights([1, 2]).items()}
    _save_plain(tmp_path / "mla", mla)
    _assert_refused(tmp_path / "mla", "multi-latent attention in Hugging Face names", out)
    prefix = "decoder.layers.0.self_attention."
    nodims = {s: {prefix + "linear_q_proj.weight": torch.zeros(4 * 24, D),
                  prefix + "linear_kv_up_proj.weight": torch.zeros(4 * 32, 16),
                  prefix + "linear_kv_down_proj.weight": torch.zeros(24, D)} for s in (1, 2)}
    _save_plain(tmp_path / "mla_nodims", nodims)
    _assert_refused(tmp_path / "mla_nodims", "multi-latent attention needs its dims", out)
    (tmp_path / "junk").mkdir()
    for step in (1, 2):
        (tmp_path / "junk" / f"ckpt_{step}.pt").write_bytes(b"not a checkpoint")
    _assert_refused(tmp_path / "junk", r"ckpt_1.pt: refused by the safe loader", out)
    _save_plain(tmp_path / "nohead", _weights([1, 2]), argparse.Namespace(hidden_size=D))
    _assert_refused(tmp_path / "nohead", "pass --model-config", out)


class _Backend(__import__("enum").Enum):
    flash = 1


class _Payload:
    """Pickles as a call of ``func(*args)``: what a malicious checkpoint holds. None of these
    globals is on torch's own blocklist (os/posix/sys/nt)."""

    def __init__(self, func, *args) -> None:
        self.func, self.args = func, args

    def __reduce__(self):
        return (self.func, self.args)


def _payloads(marker) -> dict[str, _Payload]:
    import builtins
    import subprocess

    touch = f"open({str(marker)!r}, 'w').close()"
    return {"builtins.exec": _Payload(builtins.exec, touch),
            "builtins.eval": _Payload(builtins.eval, touch),
            "subprocess.call": _Payload(subprocess.call, ["touch", str(marker)])}


@pytest.mark.parametrize("name", ["builtins.exec", "builtins.eval", "subprocess.call"])
def test_a_checkpoint_whose_pickle_would_run_code_is_refused_naming_the_file_and_global(
        tmp_path, name):
    marker = tmp_path / "pwned"
    os.makedirs(tmp_path / "run")
    for step, sd in _weights([1, 2]).items():
        torch.save({"model": sd, "args": ARGS, "hook": _payloads(marker)[name]},
                   tmp_path / "run" / f"step_{step}.pt")
    _assert_refused(tmp_path / "run", rf"step_1.pt: refused by the safe loader: the file names "
                    rf"the global {name}", tmp_path / "out")
    assert not marker.exists()


def test_an_object_of_a_class_of_the_users_own_code_is_refused(tmp_path):
    os.makedirs(tmp_path / "run")
    for step, sd in _weights([1, 2]).items():
        torch.save({"model": sd, "args": ARGS, "backend": _Backend.flash},
                   tmp_path / "run" / f"step_{step}.pt")
    _assert_refused(tmp_path / "run", r"step_1.pt: refused .* the global "
                    r"tests\.unit\.test_scan\._Backend", tmp_path / "out")


def test_framework_enums_load_but_not_where_a_weight_should_be(tmp_path):
    enums = pytest.importorskip("megatron.core.transformer.enums")
    args = argparse.Namespace(**vars(ARGS), attention_backend=enums.AttnBackend.flash)
    weights = _weights([1, 2])
    _save_plain(tmp_path / "run", weights, args)
    assert len(scan(tmp_path / "run", progress=False, plots=False).rows) == 1
    for sd in weights.values():
        sd[QKV.format(1)] = enums.AttnBackend.flash
    _save_plain(tmp_path / "swapped", weights)
    _assert_refused(tmp_path / "swapped", rf"{QKV.format(1)} holds .*flash.* where a tensor "
                    r"is expected", tmp_path / "out")


def _dcp_checkpoints(root, steps=(1, 2)) -> list:
    """Tiny torch.distributed.checkpoint directories (one process, no process group)."""
    import torch.distributed.checkpoint as dcp

    paths = []
    for step in steps:
        path = root / f"iter_{step:07d}"
        sd = {"decoder.layers.self_attention.linear_qkv.weight": torch.randn(2, 16, 8)}
        dcp.save(sd, storage_writer=dcp.FileSystemWriter(str(path)), no_dist=True)
        paths.append(path)
    return paths


def _tamper(path, edit) -> None:
    """Rewrite ``path/.metadata`` after ``edit(metadata)`` (our own file: plain pickle)."""
    meta = pickle.loads((path / ".metadata").read_bytes())
    edit(meta)
    (path / ".metadata").write_bytes(pickle.dumps(meta))


def test_distributed_checkpoint_metadata_naming_a_foreign_global_is_refused(tmp_path):
    marker = tmp_path / "pwned"
    for step in (1, 2):
        path = tmp_path / f"iter_{step:07d}"
        path.mkdir()
        (path / ".metadata").write_bytes(pickle.dumps(_payloads(marker)["builtins.exec"]))
    _assert_refused(tmp_path, r"\.metadata: refused by the safe loader: the metadata names "
                    r"builtins.exec", tmp_path / "out")
    assert not marker.exists()


def _escape(meta) -> None:
    for info in meta.storage_data.values():
        info.relative_path = "../../victim.distcp"


def _absurd_layers(meta) -> None:
    md = meta.state_dict_metadata["decoder.layers.self_attention.linear_qkv.weight"]
    md.size = torch.Size([10**12, 16, 8])


def _negative(meta) -> None:
    for md in meta.state_dict_metadata.values():
        md.chunks[0].sizes = torch.Size([2, -16, 8])


@pytest.mark.parametrize("edit, match", [
    (_escape, r"refused: the storage of .* is '\.\./\.\./victim\.distcp', outside the "
              r"checkpoint directory"),
    (_absurd_layers, r"linear_qkv\.weight \(elements\) is \d+: refused"),
    (_negative, r"chunk sizes is .*-16.*refused")])
def test_distributed_checkpoint_metadata_leaving_the_directory_or_absurd_is_refused(
        tmp_path, edit, match):
    from mechmon_megatron.scan.dist_reader import DistReader

    first, _ = _dcp_checkpoints(tmp_path)
    assert DistReader(first).tensors()  # the untouched file reads
    _tamper(first, edit)
    with pytest.raises(ScanError, match=match):
        DistReader(first)


def test_a_coherent_drift_alarms_with_attention_attribution_and_a_random_walk_stays_silent(
        tmp_path):
    steps = list(range(50, 751, 50))
    _save_plain(tmp_path / "healthy", _weights(steps, seed=1))
    _save_plain(tmp_path / "drift", _weights(steps, drift_from=450, seed=1))
    healthy = scan(tmp_path / "healthy", progress=False, plots=False)
    drift = scan(tmp_path / "drift", progress=False)
    assert healthy.alarm is None
    alarm = drift.alarm
    # The drift also grows the layer's update, so an update-ratio rule may join (compound).
    assert alarm is not None and alarm["first_family"] == "attn"
    assert alarm["fault_class"] in ("attention", "compound")
    assert alarm["onset_step"] >= 450 and alarm["alarm_step"] <= 600
    assert alarm["evidence"][0]["layer"] == 2
    assert {p.name for p in drift.files} == {"scan.jsonl", "scan.md", "scan.png"}
    text = (tmp_path / "drift" / "scan" / "scan.md").read_text()
    assert f"**{alarm['fault_class']}**" in text and "attn/" in text


def test_the_cli_exits_2_on_bad_input_and_1_on_an_alarm(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    assert main(["scan", str(tmp_path / "empty"), "--no-progress"]) == 2
    assert "no checkpoints found" in capsys.readouterr().err
    _save_plain(tmp_path / "drift", _weights(list(range(50, 751, 50)), drift_from=450, seed=1))
    code = main(["scan", str(tmp_path / "drift"), "--no-progress", "--no-plots",
                 "--out", str(tmp_path / "o")])
    assert code == 1
    assert sorted(os.listdir(tmp_path / "o")) == ["scan.jsonl", "scan.md"]
