"""anarchon"""
