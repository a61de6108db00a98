// prepare_images_reference against hand-worked values: RandomCrop(padding) with zero padding,
// flip after the crop, ToTensor, Normalize, Mixup and CutMix with the partner sample.
#include <gtest/gtest.h>

#include <vector>

#include "vitgrid/data/dataset.h"

using vitgrid::SampleAug;

namespace {

const float kMean[3] = {0.5f, 0.25f, 0.125f};
const float kStd[3] = {0.5f, 0.2f, 0.25f};

// 4x4 test image: value 10 * (y * 4 + x) + c at (y, x, c).
std::vector<uint8_t> ramp() {
  std::vector<uint8_t> v(4 * 4 * 3);
  for (int y = 0; y < 4; ++y)
    for (int x = 0; x < 4; ++x)
      for (int c = 0; c < 3; ++c) v[(y * 4 + x) * 3 + c] = (uint8_t)(10 * (y * 4 + x) + c);
  return v;
}

float norm(int byte, int c) { return (byte / 255.0f - kMean[c]) / kStd[c]; }

}  // namespace

// pad 1, crop offset (dx 0, dy 2) into the 6x6 padded image, then flip: output (y, x) is
// original (y + 1, 2 - x), worked out by hand below (P = a padded, black pixel).
TEST(PrepareImages, CropPadFlipByHand) {
  auto img = ramp();
  SampleAug a;
  a.dx = 0;
  a.dy = 2;
  a.flip = 1;
  const int P = -1;
  const int want[16] = {60, 50, 40, P,  //
                        100, 90, 80, P,  //
                        140, 130, 120, P,  //
                        P, P, P, P};
  std::vector<float> out(3 * 16, 123.0f);
  vitgrid::prepare_images_reference(out.data(), img.data(), &a, 1, 4, 1, kMean, kStd);
  for (int c = 0; c < 3; ++c)
    for (int p = 0; p < 16; ++p) {
      float expect = want[p] == P ? (0.0f - kMean[c]) / kStd[c] : norm(want[p] + c, c);
      EXPECT_FLOAT_EQ(out[c * 16 + p], expect) << "c " << c << " pixel " << p;
    }
}

// no flip, offset (2, 1): output (y, x) is original (y, x + 1), column 3 padded.
TEST(PrepareImages, CropWithoutFlip) {
  auto img = ramp();
  SampleAug a;
  a.dx = 2;
  a.dy = 1;
  std::vector<float> out(48);
  vitgrid::prepare_images_reference(out.data(), img.data(), &a, 1, 4, 1, kMean, kStd);
  EXPECT_FLOAT_EQ(out[0 * 4 + 0], norm(10, 0));       // (0,0) <- (0,1)
  EXPECT_FLOAT_EQ(out[16 + 2 * 4 + 2], norm(110 + 1, 1));  // G at (2,2) <- (2,3)
  EXPECT_FLOAT_EQ(out[32 + 1 * 4 + 3], -kMean[2] / kStd[2]);  // padded column
}

// The centre crop (dx = dy = pad, no flip) is the original image: what eval batches use.
TEST(PrepareImages, CentreIsIdentityAndBatchesAreIndependent) {
  auto img = ramp();
  std::vector<uint8_t> two(img);
  for (auto v : img) two.push_back((uint8_t)(255 - v));
  SampleAug a[2];
  a[0].dx = a[0].dy = 3;
  a[1].dx = a[1].dy = 3;
  std::vector<float> out(2 * 48);
  vitgrid::prepare_images_reference(out.data(), two.data(), a, 2, 4, 3, kMean, kStd);
  for (int i = 0; i < 2; ++i)
    for (int c = 0; c < 3; ++c)
      for (int p = 0; p < 16; ++p)
        EXPECT_FLOAT_EQ(out[i * 48 + c * 16 + p], norm(two[i * 48 + p * 3 + c], c));
}

// Mixup: lam * img + (1 - lam) * partner, the partner (sample 1 of the batch) prepared with
// its own crop and flip (its padded pixels are black too).
TEST(PrepareImages, MixupBlendsWithThePartnersOwnView) {
  auto img = ramp();
  std::vector<uint8_t> two(img);
  two.resize(96, 200);  // sample 1: flat 200
  SampleAug a[2];
  a[0].dx = 0, a[0].dy = 2, a[0].flip = 1, a[0].lam = 0.25f, a[0].partner = 1;
  a[1].dx = 2, a[1].dy = 2;  // the partner's crop: its column 3 and row 3 are padding
  std::vector<float> out(96);
  vitgrid::prepare_images_reference(out.data(), two.data(), a, 2, 4, 1, kMean, kStd);
  for (int c = 0; c < 3; ++c) {
    const float pad = -kMean[c] / kStd[c];
    // (0,0) <- original (1,2) of sample 0; the partner's (0,0) <- its (1,1): 200
    EXPECT_NEAR(out[c * 16 + 0], 0.25f * norm(60 + c, c) + 0.75f * norm(200, c), 1e-6);
    // (0,3): sample 0 padded (flipped column -1); the partner's (0,3) <- its (1,4): padded
    EXPECT_NEAR(out[c * 16 + 3], pad, 1e-6);
    // sample 1 is not mixed (no partner of its own here)
    EXPECT_FLOAT_EQ(out[48 + c * 16 + 0], norm(200, c));
  }
  // lam = 1 without a box ignores the partner exactly
  a[0].lam = 1.0f;
  std::vector<float> alone(96), with(96);
  SampleAug b[2] = {a[0], a[1]};
  b[0].partner = -1;
  vitgrid::prepare_images_reference(alone.data(), two.data(), b, 2, 4, 1, kMean, kStd);
  vitgrid::prepare_images_reference(with.data(), two.data(), a, 2, 4, 1, kMean, kStd);
  EXPECT_EQ(alone, with);
}

// CutMix: the partner's pixels inside the box [1, 3) x [0, 2), the sample's own elsewhere.
TEST(PrepareImages, CutmixPastesThePartnersBox) {
  auto img = ramp();
  std::vector<uint8_t> two(img);
  two.resize(96, 200);
  SampleAug a[2];
  a[0].dx = a[0].dy = 1;  // centre: the image itself
  a[1].dx = a[1].dy = 1;
  a[0].partner = 1;
  a[0].cut_x0 = 1, a[0].cut_x1 = 3, a[0].cut_y0 = 0, a[0].cut_y1 = 2;
  std::vector<float> out(96);
  vitgrid::prepare_images_reference(out.data(), two.data(), a, 2, 4, 1, kMean, kStd);
  for (int c = 0; c < 3; ++c)
    for (int y = 0; y < 4; ++y)
      for (int x = 0; x < 4; ++x) {
        const bool box = x >= 1 && x < 3 && y < 2;
        EXPECT_FLOAT_EQ(out[c * 16 + y * 4 + x], box ? norm(200, c) : norm(10 * (y * 4 + x) + c, c))
            << "c " << c << " y " << y << " x " << x;
      }
}
