"""Input pipeline: ImageNet-layout folders decoded and augmented in worker processes.

``ImageFolder`` lists a split's files and labels, ``ImageLoader`` yields sharded, deterministic,
resumable batches of decoded images (libjpeg-turbo where installed), ``DaliImageLoader`` decodes
training batches on the GPU with NVIDIA DALI (optional: ``pip install 'jaxring[dali]'``),
``SyntheticImages`` yields random ones without disk (``--data synthetic``),
``prefetch_to_device`` overlaps the host-to-device copies, and ``write_image_folder`` writes a
small learnable data set of real JPEG files for tests and demos.

Decoding and writing images needs the ``data`` extra (Pillow, simplejpeg, OpenCV: ``pip install
'jaxring[data]'``); without it this module still imports, and ``SyntheticImages``,
``prefetch_to_device`` and ``ImageFolder`` work.
"""
from jaxring._src.data.dali import DaliImageLoader as DaliImageLoader
from jaxring._src.data.dali import dali_error as dali_error
from jaxring._src.data.dali import make_train_loader as make_train_loader
from jaxring._src.data.decode import DECODERS as DECODERS
from jaxring._src.data.decode import fast_decoder_error as fast_decoder_error
from jaxring._src.data.folder import IMAGE_EXTENSIONS as IMAGE_EXTENSIONS
from jaxring._src.data.folder import ImageFolder as ImageFolder
from jaxring._src.data.folder import read_labels_file as read_labels_file
from jaxring._src.data.generate import class_pattern as class_pattern
from jaxring._src.data.generate import write_image_folder as write_image_folder
from jaxring._src.data.loader import WORKER_TYPES as WORKER_TYPES
from jaxring._src.data.loader import ImageLoader as ImageLoader
from jaxring._src.data.prefetch import DevicePrefetcher as DevicePrefetcher
from jaxring._src.data.prefetch import prefetch_to_device as prefetch_to_device
from jaxring._src.data.synthetic import SyntheticImages as SyntheticImages
from jaxring._src.data.transforms import CorruptImageError as CorruptImageError
from jaxring._src.data.transforms import center_crop_box as center_crop_box
from jaxring._src.data.transforms import load_image as load_image
from jaxring._src.data.transforms import random_resized_crop_box as random_resized_crop_box
from jaxring._src.data.hard_shapes import hard_shapes as hard_shapes
