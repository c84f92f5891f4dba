"""Test session set-up: 8 emulated CPU devices, set before JAX creates its backends.

One persistent compilation cache per test session (a new temporary directory, removed at exit):
tests that compile the same program (a fixture's train step and a test's own build of it, the
trainer subprocesses of one config, which inherit the directory through the environment) compile
it once. XLA still compiles every distinct program; a cached one is the same executable.

XLA:CPU compiles the tests' programs with LLVM's optimization turned down
(``--xla_backend_optimization_level=0``, expensive LLVM passes off): XLA's own HLO passes
(fusion, algebraic simplification, layout, scheduling) still run, so every program computes what
it computes at the default level, up to float rounding (which the numerics rule of
:mod:`tests.helpers.numerics` allows for); only the machine code is less tuned, and the suite
compiles in about two thirds of the time. Setting ``xla_backend_optimization_level`` in
``XLA_FLAGS`` yourself keeps yours (``XLA_FLAGS=--xla_backend_optimization_level=2`` tests the
default code generation; the trainer subprocesses inherit the flags either way).

Where libtpu is installed (the test extra on Linux x86-64), tests compile for TPU topologies on
this machine: each pytest-xdist worker loads libtpu, which by default allows one process at a
time, and one host needs no slice discovery.
"""

import atexit
import os
import shutil
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = " ".join(filter(None, [
      os.environ.get("XLA_FLAGS", ""), "--xla_backend_optimization_level=0",
      "--xla_llvm_disable_expensive_passes=true"]))
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
  _CACHE = tempfile.mkdtemp(prefix="tpipe-test-jax-cache-")
  os.environ["JAX_COMPILATION_CACHE_DIR"] = _CACHE
  atexit.register(shutil.rmtree, _CACHE, ignore_errors=True)

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)
