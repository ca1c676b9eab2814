"""Point clouds: ModelNet40 (official OFF meshes through torch-geometric, or PointNet's HDF5 copy) and
a generated set of parametric solids (``task=shapes``); see docs/pointcloud.md."""
