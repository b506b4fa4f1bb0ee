"""Benchmarks (`ganscale bench ...`): numbers with their machine and command, never timed tests.

  overhead    the trainer against a hand-written PyTorch loop (overhead.py)
  throughput  images/s, model FLOPs and MFU of DCGAN and BigGAN-style iterations (throughput.py)
  strategies  every parallel strategy through `ganscale train --nproc N`, side by side (strategies.py)
  scaling     an N-process DDP step against a 1-process step of the same per-rank batch (scaling.py)
Results go to benchmarks/results/ as Markdown and JSON (report.py).
"""
