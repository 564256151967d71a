"""Tensor parallelism over processes (gloo on CPU): the same greedy tokens and logits as one rank, the split
of weights and KV cache, and the failures a replica must not survive silently: a member that cannot reach
the leader, a rank that dies, a rank holding another checkpoint.

Each engine here starts real rank processes (``engine/worker.py``) on this host, so the tests keep the
models tiny; W1's 64 requests run with the engine's own shapes of prompts (128 tokens) and 128 outputs."""
from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import time

import pytest
import torch

from tokenfleet_serving.bench.parallel import free_port, greedy, open_engine, probe_logits, w1_prompts
from tokenfleet_serving.engine.distributed import ParallelConfig, ParallelConfigError, RankFailure
from tokenfleet_serving.engine.loader import load_config
from tokenfleet_serving.engine.model import split_error
from tokenfleet_serving.engine.rendezvous import derive_key
from tokenfleet_serving.testing_models import create_random_checkpoint

W1_OUTPUT = 128


@pytest.fixture(scope="module")
def w1_tp1(checkpoints):
    """tp=1's W1 greedy outputs and probe logits on the 'llama' checkpoint (4 heads, 2 KV heads)."""
    model = checkpoints["llama"]
    prompts = w1_prompts(load_config(model).vocab_size)
    engine = open_engine(model, 1, kv_cache_bytes=16 << 20)
    try:
        return prompts, greedy(engine, prompts, W1_OUTPUT)[0], probe_logits(engine, prompts[:4])
    finally:
        engine.close()


@pytest.mark.parametrize("tp", [2, 4])          # 2: the KV heads split; 4: each KV head replicated on 2 ranks
def test_w1_greedy_and_logits_at_tp_match_one_rank(tp, checkpoints, w1_tp1):
    prompts, want, want_logits = w1_tp1
    engine = open_engine(checkpoints["llama"], tp, threads=1, kv_cache_bytes=16 << 20)
    try:
        assert engine.group is not None and engine.group.size == tp and len(engine.followers) == tp - 1
        got = greedy(engine, prompts, W1_OUTPUT)[0]
        logits = probe_logits(engine, prompts[:4])
    finally:
        engine.close()
    assert sum(len(o) for o in got) == len(prompts) * W1_OUTPUT
    assert got == want                                       # token for token, all 64 requests
    assert logits.shape == want_logits.shape
    assert (logits - want_logits).abs().max().item() < 1e-4


@pytest.mark.parametrize("name", ["llama-biases", "llama3-tied", "qwen2"])
def test_biases_tied_embeddings_and_one_kv_head_split_over_two_ranks(name, checkpoints):
    """Row-parallel biases added once, a tied head over the vocabulary shard, a single KV head replicated."""
    prompts = w1_prompts(load_config(checkpoints[name]).vocab_size, requests=3, prompt_len=21, seed=4)
    logits = {}
    for tp in (1, 2):
        engine = open_engine(checkpoints[name], tp, threads=1, kv_cache_bytes=4 << 20)
        try:
            logits[tp] = probe_logits(engine, prompts)
        finally:
            engine.close()
    assert (logits[2] - logits[1]).abs().max().item() < 1e-4


def test_the_one_call_decoder_and_the_layer_loop_give_the_same_bits_at_tp2(tmp_path):
    """Over shared memory each rank's compiled decoder sums across the ranks itself; the layer loop (rank 0 here,
    rank 1 keeps the compiled call) must make the same rounds in the same order, with pieces of the MLP wider than
    a slot's rows (hidden 512: 1,024 rows a slot) too."""
    from tokenfleet_serving.engine import SamplingParams

    model = create_random_checkpoint(tmp_path / "wide", num_layers=2, hidden_size=512, num_heads=8, num_kv_heads=4,
                                     intermediate_size=256, vocab_size=512, initializer_range=0.2, seed=7)
    prompts = w1_prompts(512, requests=10, prompt_len=130, seed=3)         # a 1,300-row prefill step
    engine = open_engine(model, 2, threads=1, kv_cache_bytes=16 << 20, max_num_batched_tokens=2048)
    runner = engine.runner
    try:
        assert runner.decoder_call is not None and engine.group.kernel_comm is not None
        assert all(layer.piece_rows == 1024 for layer in runner.layers)
        got = {}
        for use in (True, False):
            runner.use_decoder_call = use
            seen: list[torch.Tensor] = []

            def recording(batch, all_logits=False, seen=seen, forward=runner.forward):
                seen.append(forward(batch, all_logits).clone())
                return seen[-1]

            runner.forward = recording
            try:
                engine.reset_prefix_cache()
                outs = engine.generate(prompts, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
            finally:
                del runner.forward
            got[use] = (probe_logits(engine, prompts), seen, [o.new_token_ids for o in outs])
    finally:
        engine.close()
    (prefill, steps, tokens), (prefill_loop, steps_loop, tokens_loop) = got[True], got[False]
    assert prefill.shape[0] == 1300 and torch.equal(prefill, prefill_loop)
    assert len(steps) == len(steps_loop) == 6 and all(torch.equal(a, b) for a, b in zip(steps, steps_loop))
    assert tokens == tokens_loop


def test_each_rank_holds_its_share_of_weights_and_kv(checkpoints):
    one = open_engine(checkpoints["llama"], 1, kv_cache_bytes=8 << 20)
    two = open_engine(checkpoints["llama"], 2, threads=1, kv_cache_bytes=8 << 20)
    try:
        assert two.runner.weight_bytes() < 0.55 * one.runner.weight_bytes()
        assert two.kv.pool.num_blocks == 2 * one.kv.pool.num_blocks        # 2 KV heads: one per rank
        assert two.runner.kv_pool.shape[2] == 1 and one.runner.kv_pool.shape[2] == 2
    finally:
        two.close()


def test_a_vocabulary_tp_does_not_divide_is_padded(tmp_path):
    model = create_random_checkpoint(tmp_path / "odd-vocab", vocab_size=509, initializer_range=0.2, seed=7)
    prompts = w1_prompts(509, requests=2, prompt_len=9)
    logits = {}
    for tp in (1, 2):
        engine = open_engine(model, tp, threads=1, kv_cache_bytes=2 << 20)
        try:
            logits[tp] = probe_logits(engine, prompts)
        finally:
            engine.close()
    assert logits[2].shape[1] == 509
    assert (logits[2] - logits[1]).abs().max().item() < 1e-4


def test_a_model_tp_cannot_split_is_refused_naming_the_field(checkpoints):
    config = load_config(checkpoints["llama"])           # 4 heads, 2 KV heads, 128 MLP features
    assert split_error(config, 2) is None and split_error(config, 4) is None
    assert "num_attention_heads 4" in split_error(config, 3)
    six = dataclasses.replace(config, num_heads=6, num_kv_heads=4, intermediate_size=129)
    assert "num_key_value_heads 4 and tensor parallel size 3" in split_error(six, 3)
    assert "intermediate_size 129" in split_error(dataclasses.replace(config, intermediate_size=129), 2)
    with pytest.raises(ValueError, match="--tensor-parallel-size 3: num_attention_heads 4"):
        open_engine(checkpoints["llama"], 3)


def test_parallel_flags_that_cannot_work_are_refused():
    with pytest.raises(ParallelConfigError, match="--pipeline-parallel-size 2: pipeline parallelism is not implemented"):
        ParallelConfig(2, 2, nnodes=2).check()
    with pytest.raises(ParallelConfigError, match="--nnodes 3 does not divide"):
        ParallelConfig(4, nnodes=3).check()
    with pytest.raises(ParallelConfigError, match="--node-rank 2"):
        ParallelConfig(4, nnodes=2, node_rank=2).check()


def test_serve_refuses_pp_and_warm_restart_at_tp(checkpoints):
    from tokenfleet_serving.serve_args import parse_serve_args
    from tokenfleet_serving.server.main import config_from_args

    base = ["--model", str(checkpoints["llama"])]
    with pytest.raises(ValueError, match="pipeline parallelism is not implemented"):
        config_from_args(parse_serve_args(base + ["--pipeline-parallel-size", "2"]))
    with pytest.raises(ValueError, match="--prefix-checkpoint-dir .* not implemented with --tensor-parallel-size"):
        config_from_args(parse_serve_args(base + ["--tensor-parallel-size", "2",
                                                           "--prefix-checkpoint-dir", "/tmp/x"]))
    with pytest.raises(ValueError, match="--master-addr is required"):
        config_from_args(parse_serve_args(base + ["--tensor-parallel-size", "2", "--nnodes", "2",
                                                           "--node-rank", "1", "--headless"]))
    config = config_from_args(parse_serve_args(base + ["--tensor-parallel-size", "2"]))
    assert config.engine.parallel == ParallelConfig(2, master_port=29500)


def _serve(args: list[str], env: dict) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "import sys; from tokenfleet_serving.server.main import main; "
                             "sys.exit(main(sys.argv[1:]))", *args], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def test_a_member_that_cannot_reach_the_leader_exits_in_bounded_time_naming_the_address(checkpoints, tmp_path):
    log = tmp_path / "termination-log"
    env = {**os.environ, "TOKENFLEET_TERMINATION_LOG": str(log), "TOKENFLEET_RENDEZVOUS_KEY": "replica secret"}
    port, health = free_port(), free_port()
    started = time.monotonic()
    member = _serve(["--model", str(checkpoints["llama"]), "--headless", "--tensor-parallel-size", "2", "--nnodes", "2",
                     "--node-rank", "1", "--master-addr", "127.0.0.1", "--master-port", str(port),
                     "--distributed-timeout-seconds", "3", "--port", str(health)], env)
    out, _ = member.communicate(timeout=90)
    elapsed = time.monotonic() - started
    assert member.returncode == 1, out
    assert elapsed < 3 + 45            # the join bound, plus starting Python and torch twice on a busy host
    message = log.read_text()
    assert f"rank 1 of 2 could not join the replica's group at 127.0.0.1:{port} within 3s" in message


def test_a_dead_rank_makes_rank_0_fail_fast(checkpoints):
    engine = open_engine(checkpoints["llama"], 2, threads=1, timeout_s=20, kv_cache_bytes=4 << 20)
    try:
        assert engine.group.shm is not None             # every rank on this host, on CPU: shared memory
        engine.followers[0].kill()
        engine.followers[0].wait()
        started = time.monotonic()
        # gloo: the broadcast of the batch fails (the connection closed); shared memory: the dead rank had already
        # entered that broadcast, so the step's first all-reduce finds it gone, naming it
        with pytest.raises(RankFailure, match="rank 0: (broadcast|all-reduce) failed .* a rank is gone"):
            engine.generate([[1, 2, 3]])
        assert time.monotonic() - started < 20
    finally:
        engine.close()


def test_the_server_of_a_replica_that_lost_a_rank_turns_unhealthy_and_exits(checkpoints, tmp_path):
    import json
    import urllib.error
    import urllib.request

    env = {**os.environ, "TOKENFLEET_TERMINATION_LOG": str(tmp_path / "log")}
    port = free_port()
    server = _serve(["--model", str(checkpoints["llama"]), "--tensor-parallel-size", "2", "--dtype", "float32",
                     "--master-port", str(free_port()), "--distributed-timeout-seconds", "8", "--kv-cache-mb", "4",
                     "--port", str(port), "--host", "127.0.0.1"], env)

    def health() -> int:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                return r.status
        except urllib.error.HTTPError as e:
            return e.code
        except OSError:
            return 0

    def ready() -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/ready", timeout=2) as r:
                return json.loads(r.read())["ready"]
        except OSError:
            return False
    try:
        deadline = time.monotonic() + 90
        while not ready():
            assert server.poll() is None and time.monotonic() < deadline, server.communicate()[0]
            time.sleep(0.3)
        time.sleep(3)                                   # idle: keepalives hold the follower (timeout 8 s)
        assert health() == 200
        worker = subprocess.run(["pgrep", "-f", "engine.worker .*--master-port"], capture_output=True, text=True)
        pids = [int(p) for p in worker.stdout.split()]
        mine = [p for p in pids if os.path.exists(f"/proc/{p}") and
                open(f"/proc/{p}/stat").read().split()[3] == str(server.pid)]
        assert len(mine) == 1
        os.kill(mine[0], 9)
        codes = set()
        deadline = time.monotonic() + 15
        while server.poll() is None and time.monotonic() < deadline:
            codes.add(health())
            time.sleep(0.2)
        assert 503 in codes
        assert server.wait(timeout=15) == 1
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()


def test_a_rank_with_another_checkpoint_is_refused_naming_both_revisions(checkpoints, tmp_path):
    other = create_random_checkpoint(tmp_path / "other", architecture="llama", initializer_range=0.2, seed=99)
    port = free_port()
    member = subprocess.Popen([sys.executable, "-m", "tokenfleet_serving.engine.worker", "--model", str(other),
                               "--rank", "1", "--tensor-parallel-size", "2", "--nnodes", "2", "--node-rank", "1",
                               "--master-port", str(port), "--distributed-timeout-seconds", "30"],
                              env={**os.environ, "TOKENFLEET_TERMINATION_LOG": str(tmp_path / "log"),
                                   "TOKENFLEET_RENDEZVOUS_KEY": "replica secret"})
    try:
        with pytest.raises(RankFailure, match=r"rank 1 holds another checkpoint than rank 0: revision \w+ .* "
                                              r"revision \w+ .*refusing"):
            open_engine(checkpoints["llama"], 2, threads=1,
                        parallel=ParallelConfig(2, nnodes=2, master_port=port, timeout_s=30,
                                                key=derive_key("replica secret", f"127.0.0.1:{port}")))
        assert member.wait(timeout=30) == 1
        assert "holds another checkpoint" in (tmp_path / "log").read_text()
    finally:
        if member.poll() is None:
            member.kill()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_ranks_match_one_cpu_rank(checkpoints):
    """The CUDA path: tp=1 on a GPU against the CPU, and tp=2 over NCCL where two GPUs exist."""
    prompts = w1_prompts(512, requests=8, prompt_len=32)
    cpu = open_engine(checkpoints["llama"], 1, kv_cache_bytes=4 << 20)
    want, want_logits = greedy(cpu, prompts, 16)[0], probe_logits(cpu, prompts[:4])
    sizes = [1] + ([2] if torch.cuda.device_count() >= 2 else [])
    for tp in sizes:
        gpu = open_engine(checkpoints["llama"], tp, device="cuda", kv_cache_bytes=4 << 20)
        try:
            assert gpu.device.type == "cuda"
            got, logits = greedy(gpu, prompts, 16)[0], probe_logits(gpu, prompts[:4]).cpu()
        finally:
            gpu.close()
        assert (logits - want_logits).abs().max().item() < 1e-3, tp
        assert sum(a == b for a, b in zip(got, want)) >= 7, tp


def test_prefix_caching_chunked_prefill_ngram_and_draft_speculation_and_int8_at_tp2(checkpoints):
    """The engine's levers at tp=2 give tp=1's tokens."""
    from tokenfleet_serving.engine import SamplingParams
    from tokenfleet_serving.engine.speculative import SpeculativeConfig

    model = checkpoints["llama"]
    shared = w1_prompts(512, requests=1, prompt_len=40, seed=11)[0]
    prompts = [shared + p for p in w1_prompts(512, requests=6, prompt_len=7, seed=12)]
    prompts += [(p[:5] * 6)[:28] for p in w1_prompts(512, requests=3, prompt_len=5, seed=13)]   # repetitive
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)

    def run(tp: int, **kw) -> tuple[list[list[int]], int]:
        engine = open_engine(model, tp, threads=1, kv_cache_bytes=4 << 20, block_size=4, max_num_batched_tokens=32,
                             **kw)
        try:
            engine.generate(prompts[:1], params)                   # puts the shared prefix in the cache
            outs = engine.generate(prompts, params)
            return [o.new_token_ids for o in outs], sum(o.num_cached_tokens for o in outs)
        finally:
            engine.close()

    want, _ = run(1)
    got, cached = run(2)
    assert got == want and cached >= 6 * 40 - 4                 # prefix hits; prompts chunked 32 tokens a step
    ngram, _ = run(2, speculative=SpeculativeConfig("ngram", 3, prompt_lookup_min=1, adaptive=False))
    assert ngram == want
    draft, _ = run(2, speculative=SpeculativeConfig("draft", 3, draft_model=str(model), adaptive=False))
    assert draft == want
    int8_one, _ = run(1, quantization="int8")
    int8_two, _ = run(2, quantization="int8")
    assert int8_two == int8_one          # the row-parallel shards keep the scales of whole rows


def test_each_local_rank_gets_its_share_of_the_cores_the_cgroup_allows(tmp_path):
    from tokenfleet_serving.engine.engine import cgroup_cpu_limit
    from tokenfleet_serving.engine.worker import rank_threads

    v1 = tmp_path / "v1"
    (v1 / "cpu" / "plane" / "pod").mkdir(parents=True)
    (v1 / "cpu" / "plane" / "pod" / "cpu.cfs_quota_us").write_text("200000\n")
    (v1 / "cpu" / "plane" / "pod" / "cpu.cfs_period_us").write_text("100000\n")
    (tmp_path / "v1-cgroup").write_text("4:memory:/x\n1:cpu:/plane/pod\n0::/\n")
    assert cgroup_cpu_limit(str(v1), str(tmp_path / "v1-cgroup")) == 2.0
    v2 = tmp_path / "v2"
    (v2 / "pod").mkdir(parents=True)
    (v2 / "pod" / "cpu.max").write_text("max 100000\n")
    (tmp_path / "v2-cgroup").write_text("0::/pod\n")
    assert cgroup_cpu_limit(str(v2), str(tmp_path / "v2-cgroup")) is None
    (v2 / "pod" / "cpu.max").write_text("150000 100000\n")
    assert cgroup_cpu_limit(str(v2), str(tmp_path / "v2-cgroup")) == 1.5
    assert rank_threads(ParallelConfig(2), 2) == 1 and rank_threads(ParallelConfig(4, nnodes=2), 4) == 2
    assert rank_threads(ParallelConfig(4), 2) == 1


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_the_fit_table_counts_the_bytes_each_rank_of_the_engine_keeps(tp, checkpoints):
    """bench parallel's per-rank weight arithmetic (used for the Llama-3 fit table) against the bytes the
    model of each rank really keeps (PyTorch path: weights as loaded, no packing)."""
    from tokenfleet_serving.bench.parallel import rank_weight_bytes
    from tokenfleet_serving.engine.layers.parallel import SingleRank
    from tokenfleet_serving.engine.loader import load_checkpoint
    from tokenfleet_serving.engine.model_runner import ModelRunner

    ckpt = load_checkpoint(checkpoints["llama"], with_tokenizer=False)
    for rank in range(tp):
        group = SingleRank()
        group.rank, group.size = rank, tp                # only the shapes: no collective runs here
        runner = ModelRunner(ckpt.config, ckpt.weights, torch.float32, torch.device("cpu"), 64, use_kernels=False,
                             group=group)
        assert runner.weight_bytes() == rank_weight_bytes(ckpt.config, tp, dtype_bytes=4)


def test_a_leader_whose_members_never_join_fails_in_bounded_time_naming_its_address(checkpoints):
    port = free_port()
    started = time.monotonic()
    with pytest.raises(RankFailure, match=f"rank 0 of 2 \\(the leader\\) did not see every rank join its group at "
                                          f"127.0.0.1:{port} within 2s"):
        open_engine(checkpoints["llama"], 2, parallel=ParallelConfig(2, nnodes=2, master_port=port, timeout_s=2,
                                                                     key=b"k" * 32))
    assert time.monotonic() - started < 2 + 20


def test_two_leaders_on_one_host_each_serve_their_group_on_their_own_address(checkpoints):
    """Pods of the local pod runner share the host's network: another leader listening on its own address at the
    same port must not keep this one from forming its group (torch's server alone listens on every address)."""
    import socket

    port = free_port()
    other = socket.socket()
    other.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    other.bind(("127.0.0.2", port))
    other.listen(1)
    try:
        engine = open_engine(checkpoints["llama"], 2, threads=1, kv_cache_bytes=4 << 20,
                             parallel=ParallelConfig(2, master_addr="127.0.0.3", master_port=port, timeout_s=30))
        try:
            assert engine.generate([[1, 2, 3]])
        finally:
            engine.close()
    finally:
        other.close()
