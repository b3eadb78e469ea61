#!/usr/bin/env bash
# Wheels the GPU machine lacks for `bench.gpu --random-weights`, into .whl/ (git-ignored; carry it to the device).
# That machine (torch 2.11 + CUDA 13, Python 3.12, no package index) has numpy, safetensors, huggingface_hub,
# filelock, regex, requests, Pillow and zipp; it lacks diffusers (for AutoencoderKLWan) and two of its
# pure-Python needs. transformers is not needed: the random-weights mode loads no text encoder. torch is not among
# them: a CUDA build is gigabytes, far over what a call carries, so the device's own runs (run_on_gpu.sh names it
# beside pyproject.toml's pin).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-.venv/bin/python}
rm -rf .whl && mkdir -p .whl
"$PYTHON" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 -d .whl \
  diffusers==0.42.1 importlib_metadata==10.2.0 lazy-importer==0.1.0
ls -l .whl
