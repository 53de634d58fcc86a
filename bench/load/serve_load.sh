#!/usr/bin/env bash
# Server load benchmark on the GPU machine: q3tts serve (0.6B random weights) + bench.load.load at 1/4/16/64 streams.
# The server's Python deps travel as cp312 packages unpacked into .scratch/serverdeps (carry it).
set -x
export PYTHONPATH=$PWD/.scratch/serverdeps:$PWD
nvidia-smi --query-gpu=name,memory.total --format=csv
python3 --version
python3 -c "import torch, tokenizers, huggingface_hub, safetensors, numpy, fastapi, uvicorn, pydantic; print(torch.__version__, torch.cuda.is_available(), pydantic.__version__)" || exit 1
t0=$(date +%s)
python3 -m bench.make_checkpoint --model 0.6B-CustomVoice --out /tmp/ckpt06 > $OUT/ckpt.log 2>&1 || { tail -20 $OUT/ckpt.log; exit 1; }
echo "checkpoint in $(( $(date +%s) - t0 )) s"
python3 -m q3tts.cli serve --model /tmp/ckpt06 --max-concurrent ${SLOTS:-64} --max-seq-len 1024 --port 8000 --voice-dir /tmp/vv > $OUT/serve.log 2>&1 &
SP=$!
for i in $(seq 300); do curl -sf localhost:8000/ready && break; kill -0 $SP 2>/dev/null || { tail -30 $OUT/serve.log; exit 1; }; sleep 1; done
echo "ready after $(( $(date +%s) - t0 )) s"
timeout 400 python3 -m bench.load.load --url http://127.0.0.1:8000 --concurrency ${CONC:-1,4,16,64} --requests ${REQS:-0} --max-new-tokens 126 --out $OUT/load.json 2> $OUT/load.err >/dev/null
cat $OUT/load.err
curl -s localhost:8000/metrics > $OUT/metrics.txt
kill $SP; sleep 2
tail -5 $OUT/serve.log
