"""Policies that choose compression factor or bits: plain numbers in, decisions out, no framework code."""
