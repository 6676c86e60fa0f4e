"""Model builders: the designed tiny pair, the trained tiny pair, the GGUF and HF files they are
written as, and layer-skip drafters cut from a real GGUF. Used by scripts, tests and
`crossrt drafter`; nothing on the data path imports them."""
