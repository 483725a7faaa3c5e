"""Weight quantization: FP8 (e4m3) checkpoints and FP8 quantization at load (``quant/fp8.py``)."""
