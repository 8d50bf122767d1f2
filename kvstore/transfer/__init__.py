"""How a prompt's KV moves from the prefill worker to the decode worker: the plan both sides
derive from the prompt (`plan`), the notices' fixed binary records (`notice_format`) and the
socket channel that carries them (`channel`)."""
