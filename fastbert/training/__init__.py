"""fastbert.training"""
