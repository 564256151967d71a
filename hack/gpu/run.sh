#!/usr/bin/env bash
# GPU checks of the bundled engine, from the repo root on a machine with an NVIDIA GPU and PyTorch (results:
# docs/results/cuda.md). Missing Python packages are installed from wheels in .whl/ when that folder exists;
# results go to $OUT (default: a temporary folder).
set -u
OUT=${OUT:-$(mktemp -d)}
[ -d .whl ] && { python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1; }
export PYTHONPATH=/tmp/site:$PWD/operator:$PWD/serving-image:$PWD/dev PYTHONUNBUFFERED=1
nvidia-smi -L; python3 -c "import torch; print('torch', torch.__version__, torch.cuda.is_available())"
echo "== gpu_check"; timeout 240 python3 hack/gpu/gpu_check.py 2>&1 | tee $OUT/gpu_check.log | grep -v Warning
echo "== pytest tensor parallel on cuda"
timeout 200 python3 -m pytest tests/unit/engine/test_tensor_parallel.py -k "cuda or tp_match" -q -rs -p no:cacheprovider 2>&1 | tail -15 | tee $OUT/pytest.log
echo "== serve on cuda"
python3 - <<'PY'
from tokenfleet_serving.testing_models import create_random_checkpoint
create_random_checkpoint("/tmp/m", num_layers=2, hidden_size=128, num_heads=4, num_kv_heads=2, intermediate_size=256, vocab_size=1024)
PY
timeout 120 python3 -m tokenfleet_cli serve --model /tmp/m --device cuda --port 8711 --host 127.0.0.1 > $OUT/serve.log 2>&1 &
for i in $(seq 60); do [ "$(curl -s -o /dev/null -w "%{http_code}" 127.0.0.1:8711/v1/completions -H "content-type: application/json" -d "{\"model\":\"/tmp/m\",\"prompt\":\"hi\",\"max_tokens\":1}")" = 200 ] && break; sleep 1; done
curl -s -N 127.0.0.1:8711/v1/chat/completions -H 'content-type: application/json' -d '{"model":"/tmp/m","messages":[{"role":"user","content":"hello"}],"max_tokens":8,"stream":true,"response_format":{"type":"json_object"}}' | head -c 2500; echo
curl -s 127.0.0.1:8711/metrics | grep -E "^vllm:(generation_tokens_total|prompt_tokens_total)" | head
grep -i -E "device|cuda|error" $OUT/serve.log | head -5
kill %1 2>/dev/null
