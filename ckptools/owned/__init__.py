"""What each rank holds of its own and writes as its own records: a ZeroRedundancyOptimizer's
partitions (`ckptools.owned.zero`) and the gradients of an open accumulation window
(`ckptools.owned.gradients`). The write wing, node memory and the restore ask these two modules;
nothing else knows either.
"""
