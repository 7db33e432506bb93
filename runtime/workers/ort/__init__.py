"""The ONNX Runtime CPU worker: the session with llmc's custom ops (``session``) and when its threads spin
between ops (``spin_policy``)."""
