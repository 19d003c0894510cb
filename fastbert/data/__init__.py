"""fastbert.data"""
