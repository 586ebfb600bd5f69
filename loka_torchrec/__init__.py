"""LoKA for TorchRec."""
