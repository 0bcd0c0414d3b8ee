# Set-up and checks. `make test` and `make demo` work on a fresh clone with nothing but python3.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# torch is pinned here, for the dev/test set-up only: this exact CPU wheel is what the test
# machines have locally. The library itself declares torch>=2.6 (`make compat` tests both ends).
TORCH_PIN := torch==2.13.0
STAMP := $(VENV)/.installed
INTEROP_STAMP := $(VENV)/.interop

.PHONY: fuse test lint e2e-loop stress fuzz bench demo venv clean interop golden dist docs lightning-suite accelerate-suite gpu compat compat-full

$(STAMP): pyproject.toml Makefile ckptools/_version.py
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(TORCH_PIN)
	echo "$(TORCH_PIN)" > $(VENV)/torch-constraint.txt
	$(PY) -m pip install -q -c $(VENV)/torch-constraint.txt -e '.[dev,s3,docs]'
	$(MAKE) -s fuse
	touch $(STAMP)

# FUSE for the slow and stuck storage tests (tests/_slowfs.py): Debian's fuse3 (fusermount3, libfuse3), where
# this user may install it; without it those tests skip, saying why.
fuse:
	@command -v fusermount3 >/dev/null || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
		{ timeout 120 apt-get install -y -q fuse3 >/dev/null 2>&1 || \
		  { timeout 120 apt-get update -q >/dev/null 2>&1 && timeout 120 apt-get install -y -q fuse3 >/dev/null 2>&1; }; }; } \
		|| echo "make fuse: fusermount3 is not installed here; the FUSE tests skip"

venv: $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q -m "not slow" -n auto --dist load --maxschedchunk 2

lint: $(STAMP)
	$(VENV)/bin/ruff check ckptools tests examples benchmarks
	$(VENV)/bin/ruff format --check ckptools tests examples benchmarks
	$(VENV)/bin/mypy --strict ckptools

# The flake check of the end-to-end resume tests: the whole file N times in a row (default 20).
e2e-loop: $(STAMP)
	for i in $$(seq 1 $${N:-20}); do $(PY) -m pytest -q -x -p no:cacheprovider tests/test_train_ddp_e2e.py || exit 1; done

# The long forms of the crash, kill and fuzz tests (CI runs the short forms; docs/development.md lists them).
# stress: kill -9 a saving process KILLS times (default 100) on local disk, as many times during
# background (async) saves, and 10 times on S3; 2,000 bit flips; a snapshotting torchrun job killed 50 times at
# random moments; the tutorials' ending 30 times a case; Lightning's, the HF Trainer's kill loops with 20, 5, 6
# and 3 kills (CI: 4, 2, 3, 1); prints the kill count and the corrupt/lost counts, which must be 0. Then the tests
# marked `stress`, which CI does not run at all.
stress: $(INTEROP_STAMP)
	CKPTOOLS_KILLS=$${KILLS:-100} CKPTOOLS_S3_KILLS=$${S3_KILLS:-10} CKPTOOLS_FLIPS=$${FLIPS:-2000} \
	CKPTOOLS_SNAPSHOT_KILLS=$${SNAPSHOT_KILLS:-50} CKPTOOLS_EXIT_LAUNCHES=30 CKPTOOLS_LIGHTNING_SAVER_KILLS=20 \
	CKPTOOLS_LIGHTNING_KILLS=5 CKPTOOLS_HF_KILLS=6 CKPTOOLS_LIGHTNING_RANDOM_KILLS=3 \
		$(PY) -m pytest -q -s -p no:cacheprovider --timeout=7200 tests/test_crash.py tests/test_bitrot.py \
		tests/test_s3.py::test_writer_killed_mid_upload_leaves_previous_intact \
		'tests/test_s3.py::test_every_rank_uploads_its_share_as_parts_of_one_upload[3]' \
		tests/test_s3.py::test_a_rank_killed_mid_upload_leaves_the_previous_object_and_no_upload \
		'tests/test_s3.py::test_a_restore_from_s3_reads_each_byte_once_between_the_ranks[2]' \
		'tests/test_s3.py::test_the_managers_restore_from_s3_downloads_each_byte_once_between_the_ranks[2]' \
		tests/test_s3.py::test_a_flipped_byte_in_an_object_read_once_is_one_clear_error_on_every_rank \
		tests/test_dist.py::test_a_script_ending_with_destroy_process_group_never_aborts_at_exit \
		tests/test_lightning.py::test_kill_minus_9_mid_save_never_tears_last_ckpt_lightnings_own_does \
		tests/test_lightning.py::test_ddp_fit_killed_mid_save_again_and_again_always_leaves_a_loadable_last_ckpt \
		tests/test_transformers.py::test_killed_at_random_moments_of_saves_the_newest_whole_checkpoint_is_chosen \
		tests/test_lightning_resume.py::test_one_process_killed_at_random_steps_resumes_bit_identical_and_without_it_does_not \
		tests/test_train_ddp_e2e.py::test_kill_9_at_random_moments_never_tears_a_snapshot_and_every_relaunch_is_bit_exact
	# The tests marked `stress` (repeats of kinds CI holds: docs/development.md, "What left CI").
	$(PY) -m pytest -q -p no:cacheprovider -n auto --timeout=7200 -m stress tests

# fuzz: EXAMPLES (default 3000) mutated files per fuzz test, and generated state dicts per
# differential test against torch and safetensors, instead of the default run's 40.
fuzz: $(STAMP)
	CKPTOOLS_FUZZ_EXAMPLES=$${EXAMPLES:-3000} $(PY) -m pytest -q -s -p no:cacheprovider --timeout=7200 \
		tests/test_fuzz.py tests/test_differential.py

clean:
	rm -rf $(VENV) .pytest_cache build dist site *.egg-info

# docs: regenerate the CLI reference from the typer app and the API reference's summary lines (what the
# raw Markdown shows on a code host, where the mkdocstrings directives show nothing), then build the site into site/ with
# warnings as errors (a broken link, anchor, or docstring reference fails). `make test` builds it
# too (tests/test_docs.py), and checks that the committed CLI reference is current.
docs: $(STAMP)
	$(VENV)/bin/typer ckptools.cli utils docs --name ckpt --title "CLI reference" --output docs/reference/cli.md
	$(PY) docs/tools/api_summaries.py
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict

# dist: the sdist and the wheel, checked by twine, installed into a fresh venv (torch held at the
# pin) that must run `ckpt --version` and import the package away from this checkout (--no-compile: it runs two
# commands, which compile what they import; a quarter of torch's install time saved).
dist: $(STAMP)
	rm -rf dist build/dist-venv
	$(PY) -m build --no-isolation --outdir dist .
	$(VENV)/bin/twine check --strict dist/*
	$(PYTHON) -m venv build/dist-venv
	echo "$(TORCH_PIN)" > build/torch-constraint.txt
	build/dist-venv/bin/python -m pip install -q --no-compile -c build/torch-constraint.txt dist/*.whl
	version=$$($(PY) -c 'import ckptools; print(ckptools.__version__)') && cd / && \
		$(CURDIR)/build/dist-venv/bin/ckpt --version | grep -qx "ckpt (ckptools) $$version"
	cd / && $(CURDIR)/build/dist-venv/bin/python -c "import ckptools as ck, torch; \
		assert ck.__file__.startswith('$(CURDIR)/build/dist-venv'), ck.__file__; \
		assert ck.strip_prefix({'module.w': torch.ones(1)}).keys() == {'w'}; print('installed', ck.__version__)"

# interop: install transformers, accelerate and pytorch-lightning (torch held at the pin), write
# fresh golden files with them into build/golden, and run what `make test` leaves out: the tests
# marked `interop` (the frameworks' tests, the golden files' against the fresh ones, the Lightning
# and HF guides' snippets) and those marked `slow` (whole-job scenarios), but for the `stress` ones and the
# slow ones marked `compat` (`make compat` runs those at both ends; the new end has these frameworks' releases).
# `make golden` then replaces the committed files (tests/interop/golden) with the fresh ones.
$(INTEROP_STAMP): $(STAMP)
	$(PY) -m pip install -q -c $(VENV)/torch-constraint.txt -e '.[dev,s3,docs,interop]'
	# transformers 5 writes safetensors only; the .bin shards come from transformers 4, kept apart.
	$(PY) -m pip install -q --target build/transformers4 --no-deps 'transformers>=4.50,<5' \
		'huggingface_hub>=0.30,<1.0' 'tokenizers>=0.21,<0.23'
	touch $(INTEROP_STAMP)

interop: $(INTEROP_STAMP) lightning-suite accelerate-suite
	$(PY) tests/interop/make_golden.py build/golden --transformers4 build/transformers4
	CKPTOOLS_GOLDEN=build/golden $(PY) -m pytest -q -p no:cacheprovider -n auto --dist load --maxschedchunk 1 \
		-m "(slow or interop) and not stress and not (slow and compat)" tests

# accelerate-suite: Accelerate's own checkpointing tests (third_party/accelerate_tests) with every Accelerator
# attached to ckptools; the session fails unless ckptools sealed the folders they saved.
accelerate-suite: $(INTEROP_STAMP)
	cd third_party/accelerate_tests && $(CURDIR)/$(PY) -m pytest -q -s

# lightning-suite: Lightning's own checkpointing tests (third_party/lightning_tests, from its 2.6.5 tag) with each
# ckptools plugin as every strategy's default CheckpointIO; the few that examine TorchCheckpointIO itself are
# deselected, each with its reason (third_party/lightning_tests/ckptools_default_io.py).
lightning-suite: $(INTEROP_STAMP)
	for io in sync async; do \
		(cd third_party/lightning_tests && CKPTOOLS_LIGHTNING_IO=$$io $(CURDIR)/$(PY) -m pytest -q -n auto \
			tests_pytorch/checkpointing tests_pytorch/plugins) \
			|| exit 1; \
	done

# compat: at both ends of the declared versions (torch 2.6.0 with Lightning 2.5.0, transformers 5.0.0, accelerate
# 1.7.0; torch 2.14.1 with the newest), each in a venv of its own under build/compat (installed from the package
# index, reused while the pins hold), the tests marked `versions` (fast) and `compat` (one whole job per framework
# and launcher, and each floor's). compat-full: the whole fast suite and every framework kill test there (a release).
# PIN=name==version changes one release of the ends (`make compat ENDS=old PIN=pytorch-lightning==2.4.0`).
compat:
	$(PYTHON) tests/compat/run_compat.py $(ENDS) $(if $(PIN),--pin $(PIN))

compat-full:
	$(PYTHON) tests/compat/run_compat.py --full $(ENDS)

golden: interop
	rm -rf tests/interop/golden && cp -r build/golden tests/interop/golden

# bench: save/load and CLI against torch and cp; the stall of async saves (1 and 4 GiB) against sync
# saves, DCP's async_save and the copy floor; the preemption check's cost; the reference loop's
# throughput with no, sync and async checkpoints, and a preemption's exit time and steps lost; resuming
# with every rank reading vs broadcast=True; the peak memory of a 1 GiB save to S3 (moto); resume memory
# and time of ck.load against torch.load for 1 and 4 GiB; what ck.SeededDataset costs per item and per step;
# writers="all" against "rank0" with 1, 2 and 4 ranks (plain, and each writer throttled to 200 MiB/s); node-memory
# snapshots against the copy floor; a ZeroRedundancyOptimizer saved by its owners against torch's consolidation.
bench: $(STAMP)
	$(PY) -m pip install -q -c $(VENV)/torch-constraint.txt -e '.[dev,s3,docs,peers]'
	$(PY) benchmarks/bench_peers.py --gib 0.25 1 --repeat 5 --rest 2
	$(PY) benchmarks/bench_save.py --gib 1
	$(PY) benchmarks/bench_cli.py --gib 1
	$(PY) benchmarks/bench_async.py --gib 1 4
	$(PY) benchmarks/bench_preemption.py
	$(PY) benchmarks/bench_train.py
	$(PY) benchmarks/bench_broadcast.py --gib 1 --nproc 2 4
	$(PY) benchmarks/bench_s3.py --gib 1
	$(PY) benchmarks/bench_writers.py --gib 1 --ranks 1 2 4
	$(PY) benchmarks/bench_writers.py --gib 1 --ranks 1 2 4 --repeat 2 --throttle-mib 200
	$(PY) benchmarks/bench_resume.py --gib 1 4
	$(PY) benchmarks/bench_seeded.py
	$(PY) benchmarks/bench_snapshot.py --gib 1 --repeat 7 --ranks 2 --loop
	$(PY) benchmarks/bench_frameworks.py --rounds 3 --big-gib 1
	$(PY) benchmarks/bench_zero.py --gib 0.5 --repeat 5 --ranks 2 4
	$(PY) benchmarks/bench_scale.py --mib 128 --rate-mib 8 --ranks 1 2 4 --repeat 3

# gpu: on a machine with CUDA, every CUDA test (tests/test_gpu.py) and the GPU benchmarks in one call (<= 8 min),
# one report (Markdown + JSON) in $GPU_REPORT_DIR (default gpu-report/). Without CUDA: one line, exit 0.
# No install step: a lent GPU machine has torch and the test tools but no package index, so this runs the
# checkout (PYTHONPATH) with .venv's python where there is one, else python3. GPU_DRY_RUN=1 runs what has a CPU
# form on the CPU (checks the script and the tests before a GPU is lent; proves nothing about CUDA).
gpu:
	@py=$(PY); test -x $$py || py=python3; \
		PYTHONPATH=$(CURDIR)$${PYTHONPATH:+:$$PYTHONPATH} $$py benchmarks/gpu_proof.py --report-dir "$${GPU_REPORT_DIR:-gpu-report}"

demo: $(STAMP)
	$(PY) examples/demo.py --workdir runs/demo
