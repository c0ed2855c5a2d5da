# The two commands of the README: `make demo` and `make test`.  Both create .venv on first use.
PY      ?= python3
VENV    := .venv
VPY     := $(VENV)/bin/python
NVCC    ?= $(shell command -v nvcc 2>/dev/null || echo /usr/local/cuda/bin/nvcc)
# torch: the CPU machines carry a local CPU wheel of 2.13.0; pinning it stops pip from pulling a
# multi-GB CUDA build.  On a GPU host the CUDA extra is added (cu13 when the driver is >= 580).
HAS_GPU := $(shell nvidia-smi -L >/dev/null 2>&1 && echo 1)
EXTRAS  := test,parity$(if $(HAS_GPU),$(MEMRA_DSV4_CUDA_EXTRA),)
MEMRA_DSV4_CUDA_EXTRA ?= ,cu13

.PHONY: test demo venv kernels cpu-test gpu-test clean

$(VENV)/.installed: pyproject.toml
	test -x $(VPY) || $(PY) -m venv $(VENV)
	$(VPY) -m pip install -q --upgrade pip
	$(VPY) -m pip install -q "torch==2.13.0" || $(VPY) -m pip install -q "torch>=2.4"
	$(VPY) -m pip install -q -e ".[$(EXTRAS)]"
	touch $@

venv: $(VENV)/.installed

# Every kernels_cu/*.cu compiled for sm_90a; fails on register spills or stack frames.
kernels:
	@$(VPY) tools/compile_kernels.py --nvcc "$(NVCC)"

test: venv kernels
	$(VPY) -m pytest -q

demo: venv
	$(VPY) -m memra_dsv4 demo

gpu-test: venv
	$(VPY) -m pytest -q -m gpu tests/gpu

clean:
	rm -rf $(VENV) build .memra_cache
