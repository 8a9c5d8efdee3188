"""`pdmesh quantize`: our own post-training quantizer, writing checkpoints the engine (and
the reference tools) read.

    read      the float checkpoint (HF folder or GGUF), projection by projection
    calibrate run calibration prompts through the float model (the engine, ref backend)
              and keep, per linear layer input: each channel's min and max, and for GPTQ
              the Hessian X^T X                                   (calibration.py)
    smooth    W8A8: move activation outliers into the weights, SmoothQuant-style:
              x_j / s_j, W[:, j] * s_j, folded into the RMSNorm before (smoothing.py)
    quantize  per projection: round-to-nearest (schemes.py) or GPTQ for int4 (gptq.py);
              a MoE model's routed experts with w8a8-dynamic (experts.py); MLA's kv_b_proj
              and the routers stay float (kept_float.py)
    write     compressed-tensors or msModelSlim layout (writers.py), the config/description
              that names every tensor, and the untouched tokenizer/config files
"""
