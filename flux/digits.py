"""flux/digits.py: real images with no download, for the FLUX workload: scikit-learn's bundled handwritten
digits (UCI "Optical Recognition of Handwritten Digits": 1797 8x8 images, 17 grey levels 0..16,
10 classes), and an independent judge of generated digits.

    train_x, train_y = digits.load("train")     # (N, 1, 8, 8) float32 in [-1, 1], (N,) int64
    judge, accuracy = digits.classifier()        # an RBF SVM fitted on the real training digits
    labels = digits.classify(judge, images)      # classes of (N, 1, 8, 8) images in [-1, 1]

The split is stratified (every class in proportion) and a pure function of the seed, so training
never sees a held-out image and the classifier's held-out accuracy is an honest figure. The
classifier shares nothing with the model it judges: pixels in, scikit-learn's SVC (gamma 0.001,
C 10: ~99% held-out accuracy here) out.
"""
import numpy as np
import torch

LEVELS = 16.0  # the data's grey levels are integers 0..16
N_CLASSES, SIDE = 10, 8  # digits 0..9, 8 x 8 pixels, one channel


def _split(seed, held_out):
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split
    d = load_digits()
    idx = np.arange(len(d.target))
    train, test = train_test_split(idx, test_size=held_out, stratify=d.target, random_state=seed)
    return d.images, d.target, {"train": np.sort(train), "held_out": np.sort(test)}


def load(split="train", seed=0, held_out=0.2):
    """Images (N, 1, 8, 8) scaled 0..16 -> [-1, 1] and labels (N,), of the `train` or `held_out` part."""
    if split not in ("train", "held_out"):
        raise ValueError(f"split {split!r} is not one of train, held_out")
    images, labels, parts = _split(seed, held_out)
    i = parts[split]
    x = torch.tensor(images[i], dtype=torch.float32)[:, None] / (LEVELS / 2) - 1
    return x, torch.tensor(labels[i], dtype=torch.int64)


def classify(clf, images_Nx1x8x8):
    """Predicted classes (N,) of images in [-1, 1] (values outside are clipped: samples may overshoot)."""
    pixels = ((images_Nx1x8x8.detach().float().cpu().clamp(-1, 1) + 1) * (LEVELS / 2)).reshape(len(images_Nx1x8x8), 64)
    return torch.tensor(clf.predict(pixels.numpy()), dtype=torch.int64)


def classifier(seed=0, held_out=0.2):
    """An SVC fitted on the training digits, and its accuracy on the held-out ones."""
    from sklearn.svm import SVC
    x, y = load("train", seed, held_out)
    clf = SVC(gamma=0.001, C=10).fit(((x + 1) * (LEVELS / 2)).reshape(len(x), 64).numpy(), y.numpy())
    hx, hy = load("held_out", seed, held_out)
    return clf, (classify(clf, hx) == hy).sum().item() / len(hy)


def latent_classifier(src):
    """An SVC fitted on a latent file's labelled training rows (flattened latents -> class), and its accuracy
    on the file's held-out rows: the judge of sampled latents where the decoder shows nothing (the tiny
    pipeline's random VAE, flux/tiny.py). Latents are not pixels: gamma from their variance ("scale")."""
    from sklearn.svm import SVC
    clf = SVC(C=10).fit(src.train["latents"].flatten(1).numpy(), src.train["labels"].numpy())
    held = clf.predict(src.held["latents"].flatten(1).numpy())
    return clf, float((held == src.held["labels"].numpy()).mean())


class DigitsSource:
    """The digits as a data source: images (N, 1, 8, 8) in [-1, 1], the class as the prompt."""
    cond_keys, hw, fingerprint = ("labels",), (SIDE, SIDE), None

    def __init__(self, seed):
        self.train = dict(zip(("latents", "labels"), load("train", seed)))
        self.held = dict(zip(("latents", "labels"), load("held_out", seed)))
        self.empty = (torch.tensor([N_CLASSES]),)


def upscaled(scale=4):
    """All 1797 digits as RGB uint8 (N, 8 * scale, 8 * scale, 3) pictures (nearest-neighbour: dark ink on
    white), and their labels (N,)."""
    from sklearn.datasets import load_digits
    d = load_digits()
    grey = np.kron(255 - d.images * (255 / LEVELS), np.ones((1, scale, scale))).round().astype(np.uint8)
    return np.repeat(grey[..., None], 3, axis=3), d.target


def write_images(folder, scale=4):
    """The upscaled digits as captioned PNGs in `folder`, with the metadata.jsonl flux/prepare.py reads:
    {"file_name", "text": "digit 3", "label": 3}. -> the number written."""
    import json
    import os
    from PIL import Image
    images, labels = upscaled(scale)
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "metadata.jsonl"), "w") as f:
        for i, (img, label) in enumerate(zip(images, labels)):
            Image.fromarray(img).save(os.path.join(folder, f"{i:04d}.png"))
            f.write(json.dumps({"file_name": f"{i:04d}.png", "text": f"digit {label}", "label": int(label)}) + "\n")
    return len(labels)


if __name__ == "__main__":  # python -m flux.digits OUT_DIR: the captioned images of the README's latent demo
    import sys
    print(f"{write_images(sys.argv[1])} images -> {sys.argv[1]}")
