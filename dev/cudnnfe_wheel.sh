#!/usr/bin/env bash
# Fetch cudnn-frontend (PyPI nvidia-cudnn-frontend, the Python package "cudnn"; ~12 MB) for the device machine,
# which reaches no package registry, into .cudnnfe/ (ignored by git): carry .cudnnfe on the device call that runs
# `bash dev/device_run.sh variants`, which installs it with --no-deps into $CUDNNFE_SITE. It uses the cuDNN
# libraries that PyTorch loads (sink_token needs cuDNN >= 9.13). Run from the project's root.
set -e
rm -rf .cudnnfe && mkdir -p .cudnnfe
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux2014_x86_64 \
  -d .cudnnfe "nvidia-cudnn-frontend==${CUDNNFE_VERSION:-1.32.0}"
du -sh .cudnnfe && ls .cudnnfe
