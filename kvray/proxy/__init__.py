"""The routing proxy (``python -m kvray.proxy``): PD-disaggregated and mixed serving in
front of vLLM OpenAI servers, routed by the engines' and the pool's KV events. It
imports nothing of kvray but :mod:`kvray.warn_once`."""
