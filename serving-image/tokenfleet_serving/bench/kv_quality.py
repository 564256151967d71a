"""What an int8 KV cache (``--kv-cache-dtype int8``) costs in quality and buys in capacity, for ``tokenfleet bench
kvcache`` and ``tokenfleet bench levers``.

* Quality on the reference model, against the KV cache in the model's dtype (both engines compute in fp32, so
  only the cache differs): KL(p || p_int8) and max |logit difference| of the next-token distribution over
  4,096 positions (64 sequences of 64 prompt + 64 greedy tokens, the logits of the last 64 positions of each,
  read with the context in the cache), and greedy agreement (teacher-forced, ``levers.greedy_agreement``).
* Greedy agreement on W5's copying model (``copy_task.py``), whose next token is a confident choice, not one of
  the near ties of random weights.
* Capacity at a fixed budget: the largest number of 2,048-token sequences whose KV fits at once, in the model's
  dtype and in int8. The count comes from the engine's own pool (the engine sizes it in bytes), and a run
  confirms it: that many sequences (2,040 prompt + 8 output tokens each) run at once with no preemption,
  and one more does not (the scheduler may admit its first chunk, then preempts one of them).

``measure_int8_kv`` returns the fields as a dict; ``python -m tokenfleet_serving.bench.kv_quality [--json F]``
prints them.
"""
from __future__ import annotations

import argparse
import json
import random
import tempfile
from pathlib import Path

from ..engine import LLMEngine, SamplingParams
from . import copy_task
from .engine import REFERENCE, hardware
from .levers import divergence, greedy_agreement

SEQ_LEN = 2048
BUDGET_BYTES = 1 << 30          # capacity is compared at this budget (per rank)
CONFIRM_BYTES = 64 << 20        # and confirmed by a run at this one


def _engine(model_dir: Path, **kw) -> LLMEngine:
    kw.setdefault("kv_cache_bytes", 128 << 20)
    return LLMEngine.from_pretrained(model_dir, load_tokenizer=False, **kw)


def kv_quality(model_dir: Path, vocab: int, sequences: int = 64, dtype: str = "float32") -> dict:
    """int8 KV against the model-dtype KV on one model: mean/max KL and max |logit difference| over
    ``sequences`` x 64 positions, and teacher-forced greedy agreement over 8 x 128 tokens."""
    ref, q8 = _engine(model_dir, dtype=dtype), _engine(model_dir, dtype=dtype, kv_cache_dtype="int8")
    d = divergence(ref, q8, vocab, sequences)
    g = d.pop("greedy")
    return {**d, "greedy_agreement": g["agreement"], "greedy_tokens": g["tokens"],
            "greedy_disagreements_at_near_ties": g["disagreements_at_near_ties"],
            "greedy_agreement_outside_near_ties": g["agreement_outside_near_ties"],
            "free_running_identical_fraction": g["free_running_identical_fraction"]}


def sequences_that_fit(engine: LLMEngine, seq_len: int = SEQ_LEN) -> int:
    """How many ``seq_len``-token sequences the engine's KV pool holds at once."""
    return engine.kv.pool.num_blocks // -(-seq_len // engine.kv.block_size)


def run_at_once(model_dir: Path, n: int, budget: int, vocab: int, seq_len: int = SEQ_LEN, **kw) -> dict:
    """Submit ``n`` sequences of ``seq_len`` tokens (prompt + 8 output tokens) to an engine of ``budget`` KV
    bytes; returns the most that ran at once and the preemptions."""
    eng = _engine(model_dir, kv_cache_bytes=budget, max_num_seqs=max(n, 1), max_num_batched_tokens=seq_len, **kw)
    rng = random.Random(n)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    for i in range(n):
        eng.add_request(str(i), [rng.randrange(10, vocab) for _ in range(seq_len - 8)], params)
    peak = 0
    while eng.has_unfinished():
        eng.step()
        peak = max(peak, eng.stats().num_running)
    return {"submitted": n, "most_running_at_once": peak, "preemptions": eng.stats().num_preemptions}


def capacity(model_dir: Path, vocab: int, dtype: str, confirm: bool = True) -> dict:
    """Sequences of SEQ_LEN tokens that fit in BUDGET_BYTES with the KV in the model's dtype and in int8 (and,
    with ``confirm``, the runs at CONFIRM_BYTES that show it)."""
    out: dict = {"budget_bytes": BUDGET_BYTES, "seq_len": SEQ_LEN, "dtype": dtype}
    for kv in ("auto", "int8"):
        eng = _engine(model_dir, dtype=dtype, kv_cache_dtype=kv, kv_cache_bytes=BUDGET_BYTES)
        out[kv] = {"sequences": sequences_that_fit(eng), "kv_block_bytes": eng.runner.kv_block_bytes(eng.kv.block_size),
                   "num_kv_blocks": eng.kv.pool.num_blocks}
        if confirm:
            small = sequences_that_fit(_engine(model_dir, dtype=dtype, kv_cache_dtype=kv, kv_cache_bytes=CONFIRM_BYTES))
            fits = run_at_once(model_dir, small, CONFIRM_BYTES, vocab, dtype=dtype, kv_cache_dtype=kv)
            more = run_at_once(model_dir, small + 1, CONFIRM_BYTES, vocab, dtype=dtype, kv_cache_dtype=kv)
            out[kv]["confirm"] = {"budget_bytes": CONFIRM_BYTES, "sequences": small, "run": fits, "one_more": more,
                                  "confirmed": (fits["most_running_at_once"] == small and fits["preemptions"] == 0
                                                and (more["most_running_at_once"] <= small or more["preemptions"] > 0))}
        del eng
    out["ratio"] = out["int8"]["sequences"] / out["auto"]["sequences"]
    return out


def measure_int8_kv(model_dir: Path | None = None, work: Path | None = None, sequences: int = 64,
                    w5_prompts: int = 8, w5_tokens: int = 128, confirm: bool = True, log=print) -> dict:
    """Every int8-KV measure (see the module's doc), with the field names ``bench kvcache`` reports:
    ``int8_kv_mean_kl``, ``int8_kv_max_abs_logit_diff``, ``int8_kv_greedy_agreement_w5`` and
    ``concurrent_seqs_ratio_int8`` (at BUDGET_BYTES, against bf16 KV: the model's dtype for serving; the fp32
    comparison, the engine's CPU compute dtype here, is ``concurrent_seqs_ratio_int8_vs_float32``)."""
    work = Path(work or tempfile.mkdtemp(prefix="kv-quality-"))
    if model_dir is None:
        from ..testing_models import create_random_checkpoint
        model_dir = work / "reference"
        if not (model_dir / "config.json").exists():
            create_random_checkpoint(model_dir, **REFERENCE)
    vocab = json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"]
    result: dict = {"hardware": hardware()}
    log("int8 KV quality on the reference model (fp32 compute)")
    q = kv_quality(Path(model_dir), vocab, sequences)
    result["int8_kv_reference"] = q
    result.update(int8_kv_mean_kl=q["mean_kl"], int8_kv_max_kl=q["max_kl"],
                  int8_kv_max_abs_logit_diff=q["max_abs_logit_diff"], int8_kv_kl_positions=q["kl_positions"],
                  int8_kv_greedy_agreement_reference=q["greedy_agreement"])
    log("int8 KV greedy agreement on W5's copying model")
    target = work / "copy-target"
    if not (target / "copy_task.json").exists():
        copy_task.build(target, copy_task.CIRCUIT_TARGET)
    w5 = copy_task.prompts(copy_task.W5, w5_prompts, seed=23)
    ref, q8 = _engine(target, dtype="float32"), _engine(target, dtype="float32", kv_cache_dtype="int8")
    g = greedy_agreement(ref, q8, w5, w5_tokens, 0.01)
    result["int8_kv_w5"] = g
    result["int8_kv_greedy_agreement_w5"] = g["agreement"]
    del ref, q8
    log("sequences of 2,048 tokens at a fixed budget")
    for dtype in ("bfloat16", "float32"):
        c = capacity(Path(model_dir), vocab, dtype, confirm=confirm and dtype == "bfloat16")
        result[f"capacity_{dtype}"] = c
        log(f"  {dtype}: {c['auto']['sequences']} sequences, int8 {c['int8']['sequences']} (x{c['ratio']:.3f})")
    result["concurrent_seqs_ratio_int8"] = result["capacity_bfloat16"]["ratio"]
    result["concurrent_seqs_ratio_int8_vs_float32"] = result["capacity_float32"]["ratio"]
    return result


def lever_row(result: dict, price_per_hour: float) -> dict:
    """The row ``tokenfleet bench levers`` shows for the int8 KV cache."""
    c = result["capacity_bfloat16"]
    return {"label": "+ int8 KV cache", "workload": f"{c['seq_len']}-token sequences in {c['budget_bytes'] >> 20} MiB",
            "sequences_model_dtype": c["auto"]["sequences"], "sequences_int8": c["int8"]["sequences"],
            "vs_previous": round(c["ratio"], 3), "mean_kl": result["int8_kv_mean_kl"],
            "greedy_agreement_w5": result["int8_kv_greedy_agreement_w5"], "price_per_hour": price_per_hour}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tokenfleet_serving.bench.kv_quality", description=__doc__.splitlines()[0])
    p.add_argument("--json", help="write the result here")
    p.add_argument("--work-dir", help="models are built here (and reused)")
    p.add_argument("--no-confirm", action="store_true", help="skip the runs that confirm the capacity")
    args = p.parse_args(argv)
    result = measure_int8_kv(work=Path(args.work_dir) if args.work_dir else None, confirm=not args.no_confirm)
    text = json.dumps(result, indent=2, default=str)
    if args.json:
        Path(args.json).write_text(text)
    print(json.dumps({k: v for k, v in result.items() if not isinstance(v, dict)}, indent=2, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
