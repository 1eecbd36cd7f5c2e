from trainers.qat import quantize_

__all__ = ["quantize_"]
