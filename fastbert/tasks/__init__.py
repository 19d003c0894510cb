"""fastbert.tasks"""
