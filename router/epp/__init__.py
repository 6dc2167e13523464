"""``kvgate epp``: kvgate as the endpoint picker (EPP) of an Envoy-based gateway.

Envoy streams each request to kvgate over its external-processing gRPC protocol
(``envoy.service.ext_proc.v3``) as the Gateway API Inference Extension's Endpoint Picker
Protocol specifies; kvgate keys, matches, ranks and admits it through the same decision
code as ``kvgate serve`` and answers with the endpoints Envoy is to send it to (the chosen
one first, then fallbacks); Envoy carries the bytes. Modules:

| module | what |
| --- | --- |
| ``config`` | ``EppSettings``: ``kvgate serve``'s settings and the gRPC side's |
| ``cli`` | ``kvgate epp``: flags, the simulated fleet, the process |
| ``app`` | the HTTP side (/health, /ready, /metrics, /debug) and the process's lifespan |
| ``server`` | the gRPC server: ext_proc and gRPC health |
| ``stream`` | one ext_proc stream: the protocol's messages, in order, bounded |
| ``request`` | what a request's head and body say: its kind, model, prompt, usage mode |
| ``placement`` | the one door to the decision code (routing + admission) |
| ``exchange`` | one placed request's load, metrics and access-log line until it ends |
| ``wire`` | ext_proc messages in and out: reading them, building the answers |
| ``messages`` | the ext_proc protobuf messages, declared in code (Envoy's field numbers) |
"""
