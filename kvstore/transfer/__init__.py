"""How a prompt's KV moves from the prefill worker to the decode worker: the plan both sides
derive from the prompt (`plan`), the notices' fixed binary records (`notice_format`) and the
socket channel that carries them on one node (`channel`); across nodes, Mooncake's Transfer
Engine (`engine`) writing into the decode worker's registered staging region (`staging`)."""
