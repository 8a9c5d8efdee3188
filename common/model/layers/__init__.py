"""What model files are built from: linear layers and their methods (the quantization
seam), attention, MLP, norms, embedding and LM head; each holds its weights' slots for
loading and its tensor-parallel split."""
