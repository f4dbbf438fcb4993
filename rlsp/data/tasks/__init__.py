"""Synthetic tasks written as parquet datasets with verl's columns."""
